"""VRAM management for any nn.Module, from weights that rest once in vramd's shared memory.

    with torch.device("meta"):                # or accelerate.init_empty_weights(), from_config...
        model = MyModel(config)
    managed = vramd.manage(model, "flux-dit", device="cuda:0", dtype=torch.bfloat16, limit="6GiB")
    out = model(x)                            # each unit's weights reach the device right before it runs
    print(managed.stats())

The module is filled from a lease of model NAME (served as `architecture = "weights"`; with a
[vram] table its weights rest in host memory in their onload dtype, float8 included, and a GGUF
checkpoint's quantized blocks packed, unpacked on the computation device as each unit comes).
Its units of residency are the smallest modules that hold parameters directly (or the modules
given as `units`). A hook before each unit brings its weights to the computation device in the
computation dtype (the cast runs there, as the daemon's preparing does); the units that fit stay
there, the others are dropped to make room, the most recently used first (the right choice for a
model that runs its units in the same order every call), so that the bytes of computation copies
never pass `limit`, counted here. On a GPU, while one unit computes, the next one (as the last call
ran them) is brought in on a side CUDA stream from page-locked host memory. On the CPU a thread
can do so (prefetch=True), but by default each unit is copied by its hook: a copy on a second
thread stalls the ops' threads, and made the forward slower, not faster (docs/benchmarks.md).
Tied parameters are one copy, shared submodules one unit, and any entry point works (a VAE's
`decode` as well as `forward`): the hooks are on the units, not the model. Between its unit's
calls a weight is a placeholder with no memory on the computation device, in the computation
dtype: module.device and .dtype, and a diffusers pipeline's .to() and execution device, see where
the module computes; a move or cast elsewhere, or an op on a placeholder, is a ManageError
naming the weight.

The lease reserves `limit` on the device from the daemon's budget for it, beside its own models,
for as long as the lease is open (a dead process's ends with its connection). Modules that run
one after another can share one limit and its reservation (manage(..., share=managed)).

The package, one concern a module: slot.py (one weight: its slot and its placeholder), unit.py (a
unit of residency and the room under a limit), plan.py (what is managed: the slots and units of a
module), hooks.py (the hooks on the module and the per-thread call depths), streams.py (the copies
ahead of their unit and the page-locked memory they come from), versions.py (following the
daemon's updates, and taking another set of LoRA adapters, between forwards), lora.py (the LoRA
adapters a module applies itself: read, checked, added as a unit is brought), errors.py (what it raises), api.py (what users call: manage() and Managed)."""
from .api import Managed, manage
from .errors import ManageError

__all__ = ["ManageError", "Managed", "manage"]
