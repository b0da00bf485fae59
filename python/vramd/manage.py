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
one after another can share one limit and its reservation (manage(..., share=managed))."""
from __future__ import annotations

import functools
import logging
import math
import sys
import threading
import warnings
import time
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ._cuda import host_register, host_unregister
from ._gguf import Packed, unpack
from .client import Client, connect
from .lease import Lease
from ._units import format_bytes, format_exact, parse_size

# Every module under an open manager: a module managed twice would have each manager's copies and
# placeholders put in the other's place.
_MANAGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ManageError(ValueError):
    """The module and the leased model do not fit together, a unit cannot fit the limit, or a
    managed weight is asked for outside its unit (a move or cast of the managed module)."""


class _Placeholder(torch.Tensor):
    """What the module holds for a managed weight while its unit is not running: its shape, and
    the device and dtype it computes in (what module.device and .dtype, a pipeline's .to() and
    its execution device read), with no memory. A move or cast to where it already is keeps it;
    any other op is a ManageError naming the weight."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, name: str, shape, dtype: torch.dtype, device: torch.device):
        placeholder = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        placeholder.managed_name = name
        return placeholder

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"<vramd.manage's placeholder for {self.managed_name!r}: {list(self.shape)}, {_name(self.dtype)} "
                f"on {self.device}>")

    def __reduce_ex__(self, protocol):
        # torch.save(model.state_dict()) would otherwise write a file without a single value in it.
        raise ManageError(f"{self.managed_name!r} is managed by vramd: its placeholder has no values to save or "
                          "pickle (the weights are the leased model's, as its checkpoint holds them)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, _Placeholder))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # nn.Parameter(), state_dict()
            return _Placeholder(first.managed_name, first.shape, first.dtype, first.device)
        where = f"{first.managed_name!r} is managed by vramd on {first.device} in {_name(first.dtype)}"
        if func is torch.ops.aten._to_copy.default:
            device, dtype = (kwargs or {}).get("device") or first.device, (kwargs or {}).get("dtype") or first.dtype
            raise ManageError(f"{where}: it cannot be moved or cast to {device} in {_name(dtype)}. A managed module "
                              "computes where manage() put it; close() ends the management")
        raise ManageError(f"{where}: it has values only while its unit runs, not for {func.__name__} outside it")


class _Slot:
    """One tensor the manager fills: a parameter (one object, whichever modules hold it) or a buffer."""

    def __init__(self, name: str, rest: torch.Tensor, packed: Packed | None, param: bool, places: list,
                 dtype: torch.dtype, device: torch.device):
        self.name = name
        self.rest = rest            # the leased tensor, read-only, as the daemon holds it
        self.packed = packed        # its GGUF blocks' type and the values' shape, where it rests packed
        self.param = param          # a parameter, else a buffer
        # (module's _parameters or _buffers, attribute) wherever the module registers it
        kind = "_parameters" if param else "_buffers"
        self.places = [(getattr(module, kind), attribute) for module, attribute in places]
        self.dtype = dtype if rest.is_floating_point() or packed else rest.dtype
        self.device = device
        shape = packed.shape if packed else rest.shape
        # A view of the leased memory where it can compute as it is: no copy, no bytes.
        self.in_place = device.type == "cpu" and rest.dtype == self.dtype and not packed
        self.bytes = 0 if self.in_place else math.prod(shape) * self.dtype.itemsize
        self.read = 0 if self.in_place else rest.nbytes  # what a copy reads from the lease (packed: the blocks)
        self.placeholder = self.inert(_Placeholder(name, shape, self.dtype, device))
        self.users = 0              # ready units that hold it

    def copy(self) -> torch.Tensor:
        """The tensor in its computation state: moved, then cast (or unpacked) on the device."""
        if self.in_place:
            return self.rest
        if self.packed:
            return unpack(self.rest.to(self.device, non_blocking=True), self.packed.type, self.packed.shape, self.dtype)
        # One call: a copy that does not block casts on the device, as torch's copy to a GPU says
        return self.rest.to(self.device, self.dtype, non_blocking=True)

    def inert(self, tensor: torch.Tensor) -> torch.Tensor:
        return nn.Parameter(tensor, requires_grad=False) if self.param else tensor

    def put(self, value: torch.Tensor) -> None:
        """The value in every place the module registers it: one Parameter object for all of a
        tied parameter's places (a placeholder cannot take a real tensor's data in place)."""
        if self.param and type(value) is torch.Tensor:  # a copy; not isinstance: Parameter's is slow Python
            value = nn.Parameter(value, requires_grad=False)
        for entries, attribute in self.places:
            entries[attribute] = value


class _Unit:
    def __init__(self, name: str, module: nn.Module, paths: list[str], slots: list[_Slot]):
        self.name = name
        self.module = module
        self.paths = paths          # wherever the module is, a module shared by several parents under each
        self.slots = slots
        self.bytes = sum(slot.bytes for slot in slots)
        self.shares = False         # a slot of another unit's too (a tied weight, or a module under two units)
        self.ready = False
        self.in_use = 0
        self.pending: Future | tuple | None = None  # a prefetch under way: a Future, or (event, tensors) on a GPU

    def missing(self) -> int:
        """The bytes it needs brought in, not ready: a slot another ready unit holds is there."""
        return sum(slot.bytes for slot in self.slots if slot.users == 0) if self.shares else self.bytes


class _Room:
    """A limit on one device and what counts against it: the copies of the managed modules that
    share it (manage(share=...)), the ready units no op uses, the threads running units; one lock
    for all of them. The lease that reserved the limit is told the peak, and ends with the last
    module."""

    def __init__(self, limit: int | None, device: torch.device, lease: Lease):
        self.limit = limit
        self.device = device
        self.lease = lease
        self.lock = threading.RLock()
        self.freed = threading.Condition(self.lock)
        # Threads running units: units in use by each, and those waiting for room one of them frees.
        self.running: dict[int, int] = {}
        self.waiting: set[int] = set()
        self.held = 0
        self.peak = 0
        self.told = 0  # the peak the daemon last heard
        # Ready units no op uses, the most recently used last: what _make_room drops from.
        self.idle: dict[_Unit, None] = {}
        self.members: list[Managed] = []

    def units(self):
        return (unit for member in self.members for unit in member._units)


_log = logging.getLogger("vramd")


class _Told:
    """What manage() says of its steps as it takes them (a large model's lease and hooks take
    seconds): logged at INFO on the "vramd" logger, and with `progress` on standard error too,
    each with the seconds since manage() began."""

    def __init__(self, model: str, progress: bool | None):
        self.model = model
        self.started = time.perf_counter()
        self.shown = sys.stderr.isatty() if progress is None else progress

    def __call__(self, text: str) -> None:
        line = f"{self.model!r}: {text} ({time.perf_counter() - self.started:.2f} s)"
        _log.info(line)
        if self.shown:
            print(f"vramd.manage: {line}", file=sys.stderr, flush=True)


class Managed:
    """A module whose weights vramd manages; see manage(). `stats()` gives the figures, `close()`
    (or the end of a `with` block) takes the hooks away and ends the lease."""

    def __init__(self, module: nn.Module, lease: Lease, device: torch.device, dtype: torch.dtype, limit: int | None,
                 units: list[str] | None, strict: bool, prefetch: bool, room: _Room | None = None,
                 forward_methods: list[str] = (), told=lambda text: None):
        self.module = module
        self._forward_methods = _forward_methods(module, forward_methods)
        self.lease = lease
        self.device = device
        self.dtype = dtype
        self._room = room = room or _Room(limit, device, lease)
        limit = room.limit
        # The room's, shared with every module sharing its limit.
        self._lock, self._freed, self._idle = room.lock, room.freed, room.idle
        self._running, self._waiting = room.running, room.waiting
        self._figures = {"bytes_moved": 0, "bytes_read": 0, "loads": 0, "prefetched": 0,
                         "prefetch_hits": 0, "waited_seconds": 0.0, "hook_seconds": 0.0, "pin_seconds": 0.0,
                         "pinned_bytes": 0}
        self._next: dict[_Unit, _Unit] = {}
        self._thread_local = threading.local()  # .previous: the unit this thread ran last
        self._units = self._plan(units, strict)
        self._slots = {slot for unit in self._units for slot in unit.slots}
        self._least, nested = self._most_held_at_once()
        if limit is not None and self._least > limit:
            where = f"in {_name(dtype)} on {device}, more than the limit of {format_bytes(limit)}" + \
                (f" it shares with {_listed([m.lease.manifest['model'] for m in room.members])}" if room.members else "")
            if len(nested) == 1:
                raise ManageError(f"unit {nested[0].name!r} needs {format_exact(self._least)} {where}: raise the limit, or "
                                  "name smaller units")
            raise ManageError(f"units {_listed([u.name for u in nested])} run one inside another, so they need "
                              f"{format_exact(self._least)} at once {where}: raise the limit")
        largest = max((unit.bytes for unit in self._units), default=0)
        told(f"{len(self._units)} units, the largest {format_bytes(largest)} in {_name(dtype)} on {device}, limit "
             f"{format_bytes(limit) if limit is not None else 'none'}")
        for slot in self._slots:  # refused above, the module is as it was
            slot.put(slot.placeholder)
        self.prefetch = prefetch
        self._side = torch.cuda.Stream(device) if device.type == "cuda" and prefetch else None
        self._consumers: dict[torch.cuda.Stream, None] = {}  # the streams that computed with prefetched copies
        on_cpu = device.type == "cpu" and prefetch
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vramd-prefetch") if on_cpu else None
        self._registered = self._pin() if device.type == "cuda" else []
        if self._registered:
            told(f"page-locked {format_bytes(self._figures['pinned_bytes'])} of the lease for {device}")
        self._wrapped: list[tuple] = []  # (module, method, its own before, ours)
        self._warned_autograd = False
        self._version = lease.version  # the version of the values its slots bring
        self._calls: dict[int, int] = {}  # threads inside the module's forward methods, and how deep
        self._taking = 0  # wait_update()s waiting for the forwards under way: new ones wait for them
        self._arrived: dict | None = None  # a version a wait_update() received but could not take in time
        self._hook()
        with self._lock:  # another thread may be making room from the units of the modules sharing it
            room.members.append(self)
        told(f"{type(module).__name__} managed")

    @property
    def limit(self) -> int | None:
        """The bytes its copies may hold on its device, with those of the modules sharing it."""
        return self._room.limit

    # What is managed.

    def _plan(self, names: list[str] | None, strict: bool) -> list[_Unit]:
        leased, packs = self.lease.state_dict, self.lease.packed
        every = dict(self.module.named_modules(remove_duplicate=False))
        # Each parameter and buffer object once, with every name it has and every place it is registered.
        aliases: dict[int, list[str]] = {}
        found: dict[int, tuple[torch.Tensor, bool, list]] = {}
        for module_name, module in every.items():
            for kind in ("_parameters", "_buffers"):
                for attribute, tensor in getattr(module, kind).items():
                    if tensor is None:
                        continue
                    aliases.setdefault(id(tensor), []).append(f"{module_name}.{attribute}" if module_name else attribute)
                    _, _, places = found.setdefault(id(tensor), (tensor, kind == "_parameters", []))
                    if (module, attribute) not in places:
                        places.append((module, attribute))
        managed = [name or type(self.module).__name__ for name, module in every.items() if module in _MANAGED]
        if managed:  # each manager would put its copies and placeholders in the other's place
            raise ManageError(f"{type(self.module).__name__} is managed already: {_listed(managed)} under a "
                              "vramd.manage that has not been closed; close() it first")
        slots: dict[int, _Slot] = {}
        missing, mismatched = [], []
        for key, (tensor, is_param, places) in found.items():
            name = next((n for n in aliases[key] if n in leased), None)
            if name is None:
                if is_param or tensor.is_meta:
                    missing.append(aliases[key][0])
                elif tensor.device != self.device:  # a buffer of the module's own: where it computes
                    for module, attribute in places:
                        module._buffers[attribute] = tensor.to(self.device)
                continue
            rest, packed = leased[name], packs.get(name)
            shape = packed.shape if packed else tuple(rest.shape)
            if shape != tuple(tensor.shape):
                mismatched.append(f"{name!r} is {list(shape)} leased, {list(tensor.shape)} in the module")
                continue
            slots[key] = _Slot(name, rest, packed, is_param, places, self.dtype, self.device)
        unexpected = sorted(set(leased) - {n for key in slots for n in aliases[key]})
        problems = []
        if mismatched:
            problems.append(f"{len(mismatched)} mismatched: " + ", ".join(mismatched[:8]) +
                            (", ..." if len(mismatched) > 8 else ""))
        if missing:
            problems.append(f"{len(missing)} without a leased tensor: " + _listed(missing) +
                            " (buffers made on the meta device: build the module with accelerate.init_empty_weights(), "
                            "which leaves buffers real, or lease a checkpoint that holds them)")
        if strict and unexpected:
            problems.append(f"{len(unexpected)} leased tensors the module does not hold: " + _listed(unexpected) +
                            " (strict=False leaves them out)")
        if problems:
            raise ManageError(f"model {self.lease.manifest['model']!r} does not fit {type(self.module).__name__}: " +
                              "; ".join(problems))

        # Each slot's units: the innermost given unit that holds it, else the module holding it directly.
        given = list(names or [])
        for name in given:
            if name not in every:
                raise ManageError(f"unit {name!r} is not a module of {type(self.module).__name__}")
            if type(every[name]).forward is nn.Module.forward:  # a ModuleList, say: only its modules run
                raise ManageError(f"unit {name!r} is a {type(every[name]).__name__}, which is never called (only the "
                                  "modules it holds are): name those")

        def covering(path: str) -> str | None:
            named = [n for n in given if n == "" or path == n or path.startswith(n + ".")]
            return max(named, key=len) if named else None

        paths: dict[int, list[str]] = {}  # a module shared by several parents runs under each of them
        for path, module in every.items():
            paths.setdefault(id(module), []).append(path)
        by_unit: dict[str, list[_Slot]] = {}
        for module_name, module in self.module.named_modules():
            # Its weights' unit: the innermost given unit over each of its paths, where all agree; else
            # the module itself (called from outside a given unit, its weights must come with it).
            owners = {covering(path) for path in paths[id(module)]}
            owner = owners.pop() if len(owners) == 1 else None
            for kind in ("_parameters", "_buffers"):
                for tensor in getattr(module, kind).values():
                    slot = slots.get(id(tensor)) if tensor is not None else None
                    if slot is None:
                        continue
                    unit = by_unit.setdefault(owner if owner is not None else module_name, [])
                    if slot not in unit:
                        unit.append(slot)
        units = [_Unit(name, every[name], paths[id(every[name])], unit_slots) for name, unit_slots in by_unit.items()]
        held = Counter(slot for unit in units for slot in unit.slots)
        for unit in units:
            unit.shares = any(held[slot] > 1 for slot in unit.slots)
        return units

    def _most_held_at_once(self) -> tuple[int, list[_Unit]]:
        """The most bytes units hold while they run one inside another (a module holding weights of
        its own around the units under it: it is in use while they run), and those units, the
        outermost first. A unit alone is the least of it."""
        at = {path: unit for unit in self._units for path in unit.paths}
        most, nested = 0, []
        for unit in self._units:
            for path in unit.paths:
                around = [at[p] for p in _enclosing(path) if p in at]
                chain = list(dict.fromkeys(around + [unit]))
                held = sum(slot.bytes for slot in {slot for u in chain for slot in u.slots})
                if held > most:
                    most, nested = held, chain
        return most, nested

    def _pin(self) -> list[int]:
        """Page-locks the leased host memory once (again for each version taken), so that copies to
        the GPU run at the bus's speed."""
        started = time.perf_counter()
        registered, failed = [], {}
        self._figures["pinned_bytes"] = 0
        cudart = torch.cuda.cudart()
        for region in self.lease._regions:
            with warnings.catch_warnings():  # read-only on purpose
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                address = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
            error = host_register(address, len(region), 0x08)  # cudaHostRegisterReadOnly
            if error == 0:
                registered.append(address)
                self._figures["pinned_bytes"] += len(region)
            else:
                why = cudart.cudaGetErrorString(error)
                failed[why] = failed.get(why, 0) + len(region)
        self._figures["pin_seconds"] += time.perf_counter() - started
        if failed:  # copies from pageable memory hold the host until each is staged: slower, not wrong
            warnings.warn(f"vramd.manage: page-locking {format_bytes(sum(failed.values()))} of the lease of "
                          f"{self.lease.manifest['model']!r} failed ({', '.join(failed)}): their copies to {self.device} "
                          "wait for the host", stacklevel=4)
        return registered

    def _unpin(self) -> None:
        """Gives the page-locked memory back, once no copy from it is under way."""
        if self._registered:
            torch.cuda.synchronize(self.device)
            for address in self._registered:
                host_unregister(address)
            self._registered = []

    # Hooks.

    def _hook(self) -> None:
        """Wraps each unit's forward: its weights come in before it runs and are let go after, even
        when it raises (a forward hook would not run on Ctrl-C, and a unit left in use could never
        be dropped again; a wrapper also costs less a call). Wraps _apply (what .to(), .half() and
        .cuda() call) of each module holding managed weights, so that a move or cast the manager
        cannot honour is refused before anything changes."""
        self._hooked = True
        for module in self.module.modules():
            _MANAGED[module] = self
        for unit in self._units:
            self._wrap(unit.module, "forward", functools.partial(self._managed_forward, unit))
        for module, method in self._forward_methods:
            self._wrap(module, method, self._module_forward)
        every = dict(self.module.named_modules(remove_duplicate=False))
        held: dict[nn.Module, set[_Slot]] = {}  # the slots of the units under each module, by any of their paths
        for unit in self._units:
            for path in unit.paths:
                for name in _enclosing(path) + [path]:
                    held.setdefault(every[name], set()).update(unit.slots)
        for module, slots in held.items():
            self._wrap(module, "_apply", functools.partial(self._guarded_apply, slots))

    def _wrap(self, module: nn.Module, method: str, make) -> None:
        """Gives `module` a `method` of its own, make(the one it has), as accelerate's and
        diffusers' hooks do; _unwrap() gives back what it had."""
        own = module.__dict__.get(method)  # an instance's own (another library's hook), else the class's
        ours = make(getattr(module, method))
        setattr(module, method, ours)
        self._wrapped.append((module, method, own, ours))

    def _unwrap(self) -> None:
        for module, method, own, ours in reversed(self._wrapped):
            if module.__dict__.get(method) is not ours:
                continue  # wrapped in turn by another library since: ours now passes calls through
            if own is None:
                delattr(module, method)
            else:
                setattr(module, method, own)
        self._wrapped = []
        self._hooked = False
        for module in self.module.modules():
            if _MANAGED.get(module) is self:
                del _MANAGED[module]

    def _managed_forward(self, unit: _Unit, inner):
        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not self._hooked:  # closed, but wrapped in turn by another library: its forward as it was
                return inner(*args, **kwargs)
            if not self._warned_autograd and torch.is_grad_enabled():
                self._warn_autograd(unit, args, kwargs)
            self._acquire(unit)
            try:
                return inner(*args, **kwargs)
            finally:
                self._done(unit)
        return forward

    def _module_forward(self, inner):
        """The module's own forward (or a method named as one), counted: wait_update() takes a
        version between forwards."""
        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not self._hooked:
                return inner(*args, **kwargs)
            self._begin_call()
            try:
                return inner(*args, **kwargs)
            finally:
                self._end_call()
        return forward

    def _begin_call(self) -> None:
        """A forward of the module begins on this thread: where a wait_update() waits for those
        under way, after it."""
        with self._lock:
            if not self._calls.get(threading.get_ident()):
                while self._taking:
                    self._freed.wait()
            _enter(self._calls)

    def _end_call(self) -> None:
        with self._lock:
            if _leave(self._calls) and self._waiting:
                self._freed.notify_all()

    def _warn_autograd(self, unit: _Unit, args, kwargs) -> None:
        """Once: autograd keeps what a backward needs (the weights, where an input requires grad)
        alive until that backward, out of the manager's reach."""
        if self.limit is None or not any(isinstance(t, torch.Tensor) and t.requires_grad
                                         for t in tree_leaves((args, kwargs))):
            return
        self._warned_autograd = True
        warnings.warn(f"vramd.manage: unit {unit.name!r} runs under autograd with an input that requires grad, so "
                      f"autograd keeps the weights its backward needs until then, beyond the limit of "
                      f"{format_bytes(self.limit)} the manager counts: run under torch.no_grad() or "
                      "torch.inference_mode() for the limit to hold", stacklevel=3)

    def _guarded_apply(self, slots: set[_Slot], inner):
        def _apply(fn, *args, **kwargs):
            if self._hooked:
                for slot in slots:
                    fn(slot.placeholder)  # a placeholder moved or cast where it is not: ManageError, nothing changed
            return inner(fn, *args, **kwargs)
        return _apply

    def _acquire(self, unit: _Unit) -> None:
        started = time.perf_counter()
        with self._lock:
            previous = getattr(self._thread_local, "previous", None)
            if previous is not None and previous is not unit:
                self._next[previous] = unit  # the order the last call ran them in (each thread's own)
            self._thread_local.previous = unit
            if unit.pending is not None:
                self._figures["prefetch_hits"] += 1
                self._finish_prefetch(unit)
            elif not unit.ready:
                self._make_room(unit, keep={unit}, wait=True)
                # A wait let other threads run: one may have brought this unit in, or begun to.
                if unit.pending is not None:
                    self._finish_prefetch(unit)
                elif not unit.ready:
                    self._bring(unit, {slot: slot.copy() for slot in unit.slots if slot.users == 0})
            following = self._next.get(unit) if self.prefetch else None
            if following is not None and not following.ready and following.pending is None:
                self._prefetch(following, current=unit)
            unit.in_use += 1  # last: a unit whose hook raised is not in use
            _enter(self._running)
            self._idle.pop(unit, None)
            self._figures["hook_seconds"] += time.perf_counter() - started

    def _done(self, unit: _Unit) -> None:
        with self._lock:
            unit.in_use -= 1
            _leave(self._running)
            if unit.in_use == 0 and unit.ready:
                self._idle.pop(unit, None)
                self._idle[unit] = None
                if self._waiting:
                    self._freed.notify_all()

    # Moving weights.

    def _bring(self, unit: _Unit, copies: dict[_Slot, torch.Tensor]) -> None:
        """Puts a unit's copies in place and counts them. A slot another unit holds is shared, not
        copied twice; one that another unit let go of while this one's copies were made is made now."""
        for slot in unit.slots:
            if slot.users == 0:
                value = copies.get(slot)
                if value is None:
                    self._make_room(slot.bytes, keep={unit})
                    value = slot.copy()
                slot.put(value)
                self._room.held += slot.bytes
                self._figures["bytes_moved"] += slot.bytes
                self._figures["bytes_read"] += slot.read
            slot.users += 1
        unit.ready = True
        self._figures["loads"] += 1
        self._count_peak()

    def _count_peak(self) -> None:
        """The peak, told to the daemon (which shows it beside the lease's reservation) as it grows."""
        room = self._room
        if room.held <= room.peak:
            return
        room.peak = room.held
        if room.held >= room.told + max(1, (room.limit or 0) // 64):  # a line per 1/64 of the limit at most
            room.told = room.held
            try:
                room.lease._sock.sendall(b'{"peak": %d}\n' % room.held)
            except (OSError, AttributeError):  # the lease has ended: nobody to tell
                pass

    def _drop(self, unit: _Unit) -> None:
        for slot in unit.slots:
            slot.users -= 1
            if slot.users == 0:
                slot.put(slot.placeholder)
                self._room.held -= slot.bytes
        unit.ready = False
        self._idle.pop(unit, None)

    def _make_room(self, need: int | _Unit, keep: set, prefetch: bool = False, wait: bool = False) -> bool:
        """Drops ready units that no op uses (the most recently used first) until `need` more
        bytes fit the limit: a number, or what a unit misses, counted again as units go (one
        dropped may have held a weight the unit shares). False for a prefetch that would not fit.
        With `wait` (a unit's hook, before it changes anything), waits while another thread runs a
        unit that will free room; raises when none does. Units of the modules sharing the limit
        are dropped as this one's are."""
        room = self._room
        if room.limit is None:
            return True
        me = threading.get_ident()
        coming = need if isinstance(need, _Unit) else None
        while room.held + (more := coming.missing() if coming else need) > room.limit:
            dropped = next((u for u in reversed(self._idle) if u not in keep), None)
            if dropped is not None:
                self._drop(dropped)
                continue
            if prefetch:
                return False
            pending = next((u for u in room.units() if u.pending is not None and u not in keep), None)
            if pending is not None:  # room kept for a unit a thread may not run soon (or ever: it raised)
                self._cancel_prefetch(pending)
                continue
            if not wait or not any(thread != me and thread not in self._waiting for thread in self._running):
                in_use = [u.name for u in room.units() if u.in_use]
                raise ManageError(f"the limit of {format_bytes(room.limit)} cannot hold {format_bytes(more)} more beside "
                                  f"{format_bytes(room.held)} held by "
                                  f"units in use ({', '.join(map(repr, in_use))}): raise the limit")
            self._waiting.add(me)
            try:
                self._freed.wait()
            finally:
                self._waiting.discard(me)
        return True

    def _prefetch(self, unit: _Unit, current: _Unit) -> None:
        if not self._make_room(unit, keep={unit, current}, prefetch=True):
            return
        wanted = [slot for slot in unit.slots if slot.users == 0]
        reserved = sum(slot.bytes for slot in wanted)
        self._room.held += reserved  # counted from now, so that nothing else takes the room
        self._count_peak()
        try:
            if self._side is not None:
                # The copies come from the side stream's pool, where a prefetched copy goes back as soon
                # as it is dropped (no record_stream, whose deferred frees count as allocated and cost
                # an event each): the side stream first waits for the work queued so far on the
                # streams that computed with such copies, which includes every kernel that read one.
                for stream in self._consumers:
                    self._side.wait_stream(stream)
                with torch.cuda.stream(self._side):
                    copies = {slot: slot.copy() for slot in wanted}
                    event = torch.cuda.Event()
                    event.record(self._side)
                unit.pending = (event, copies)
            else:
                unit.pending = self._thread.submit(lambda: {slot: slot.copy() for slot in wanted})
        except BaseException:  # out of memory, say: the room is not kept for a copy that never came
            self._room.held -= reserved
            raise
        self._figures["prefetched"] += 1

    def _cancel_prefetch(self, unit: _Unit) -> None:
        """Lets a prefetch's copies go unused. On a GPU no other stream has used them, so their
        memory goes back to the side stream's pool, in its order."""
        if isinstance(unit.pending, Future):
            copies = unit.pending.result()
        else:
            _, copies = unit.pending
        unit.pending = None
        self._room.held -= sum(slot.bytes for slot in copies)

    def _finish_prefetch(self, unit: _Unit) -> None:
        started = time.perf_counter()
        if isinstance(unit.pending, Future):
            copies = unit.pending.result()
        else:
            event, copies = unit.pending
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            self._consumers[stream] = None  # made on the side stream, used on this one: see _prefetch
        self._figures["waited_seconds"] += time.perf_counter() - started
        unit.pending = None
        self._room.held -= sum(slot.bytes for slot in copies)  # the room it kept; _bring counts what it puts
        self._bring(unit, copies)

    # The user's side.

    def stats(self) -> dict:
        """Bytes held now and at most on the device, bytes moved (the copies, in the computation
        dtype) and read (from the lease: its dtype, or GGUF blocks packed), loads, prefetches and
        their hits, and the host's seconds spent waiting for prefetches and in the hooks before
        units (the waits included: what the manager adds to a call on the host), and in page-locking
        the leased memory once (on a GPU, part of manage()), with the bytes page-locked; and the
        least limit the module runs under (its largest unit, or units running one inside another).
        Held, peak and limit are those of the limit, with the modules sharing it (manage(share=)),
        the rest this module's own."""
        with self._lock:
            return {**self._figures, "held": self._room.held, "peak": self._room.peak, "limit": self.limit,
                    "least_limit": self._least,
                    "device": str(self.device),
                    "dtype": _name(self.dtype), "units": len(self._units),
                    "ready_units": sum(unit.ready for unit in self._units)}

    @property
    def version(self) -> int:
        """The version of the weights its units bring (the daemon's count of updates)."""
        return self._version

    def wait_update(self, timeout: float | None = None) -> int:
        """Waits for the daemon's next version of the model's weights (manage(..., follow=True))
        and takes it between forwards: once the module's forwards (and calls of its forward_methods)
        under way on other threads have ended (those that would begin meanwhile wait for it), the
        units' copies of the version before are dropped and each unit brings the new values when it
        next runs. So each forward runs on one version. Returns the version. Raises TimeoutError
        after `timeout` seconds (where the version came but the forwards under way did not end in
        time, the next call takes it), ManageError from inside a forward or for a module managed
        without follow=True, vramd.DaemonError when the lease has ended."""
        me = threading.get_ident()
        if self._calls.get(me) or self._running.get(me):
            raise ManageError(f"wait_update() of {self!r} from inside its forward: call it between forwards")
        if self.lease._reader is None:
            raise ManageError(f"{self!r} does not follow updates: manage it with follow=True")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._arrived is None:
            self._arrived = self.lease.wait_update(timeout)
        state_dict = self._arrived
        with self._lock:
            self._taking += 1
            self._waiting.add(me)
            try:
                # Forwards of the module on other threads, and its units called outside them (a VAE's
                # decode not named in forward_methods).
                while self._calls or any(unit.in_use for unit in self._units):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"version {self.lease.version} of {self.lease.manifest['model']!r} came, but "
                                           f"the forwards under way on other threads did not end within {timeout} s: "
                                           "the next wait_update() takes it")
                    self._freed.wait(left)
            finally:
                self._waiting.discard(me)
                self._taking -= 1
                self._freed.notify_all()  # forwards waiting to begin: they do once this lock is let go
            for unit in self._units:
                if unit.pending is not None:
                    self._cancel_prefetch(unit)
                if unit.ready:
                    self._drop(unit)
            changed = [f"{slot.name!r} is {list(new.shape)} {_name(new.dtype)}, {list(slot.rest.shape)} "
                       f"{_name(slot.rest.dtype)} before" for slot in self._slots
                       if ((new := state_dict[slot.name]).shape, new.dtype) != (slot.rest.shape, slot.rest.dtype)]
            if changed:  # never from an update, which keeps shapes and dtypes
                raise ManageError(f"version {self.lease.version} of {self.lease.manifest['model']!r}: "
                                  f"{', '.join(changed)}")
            self._unpin()  # before the version before is unmapped
            for slot in self._slots:
                slot.rest = state_dict[slot.name]
            if self.device.type == "cuda":
                self._registered = self._pin()
            self._arrived = None
            self._version = self.lease.version
        return self._version

    def close(self) -> None:
        """Takes the hooks away, drops every copy and ends the lease (the module's weights are
        meta tensors again). The lease that reserved a shared limit ends with the last module
        sharing it."""
        self._unwrap()
        room = self._room
        with self._lock:
            for unit in self._units:
                if unit.pending is not None:
                    self._finish_prefetch(unit)
                if unit.ready:
                    unit.in_use = 0
                    self._drop(unit)
            for slot in self._slots:
                slot.put(slot.inert(torch.empty(slot.placeholder.shape, dtype=slot.dtype, device="meta")))
            if self in room.members:
                room.members.remove(self)
            ending = [self.lease] if self.lease is not room.lease else []
            if not room.members:
                ending.append(room.lease)
        if self._thread is not None:
            self._thread.shutdown()
        self._unpin()
        for lease in ending:
            lease.close()

    def __enter__(self) -> "Managed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<vramd.Managed {self.lease.manifest.get('model')!r} on {self.device} in "
                f"{_name(self.dtype)}, {len(getattr(self, '_units', []))} units, limit "
                f"{format_bytes(self.limit) if self.limit is not None else 'none'}>")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _enclosing(path: str) -> list[str]:
    """The names of the modules around module `path`, the outermost first: "", "a", "a.b" for "a.b.c"."""
    parts = path.split(".") if path else []
    return [".".join(parts[:depth]) for depth in range(len(parts))]


def _enter(depths: dict[int, int]) -> None:
    """This thread one level deeper in `depths` (the threads inside something, and how deep)."""
    me = threading.get_ident()
    depths[me] = depths.get(me, 0) + 1


def _leave(depths: dict[int, int]) -> bool:
    """This thread one level out of `depths`; True where it is out altogether."""
    me = threading.get_ident()
    if depths[me] > 1:
        depths[me] -= 1
        return False
    del depths[me]
    return True


def _forward_methods(module: nn.Module, names) -> list[tuple[nn.Module, str]]:
    """The module's forward and the methods `names` names ("decode", or "decoder.forward" for a
    submodule's), each once, as (module, method)."""
    if isinstance(names, str):
        raise ManageError(f"forward_methods= takes a list of method names, not the string {names!r}")
    found: dict[tuple[int, str], tuple[nn.Module, str]] = {}
    for name in ["forward", *names]:
        path, _, method = name.rpartition(".")
        try:
            owner = module.get_submodule(path)
        except AttributeError:
            raise ManageError(f"forward_methods: {type(module).__name__} has no module {path!r} (in {name!r})") from None
        if not callable(getattr(owner, method, None)) or method.startswith("__"):
            raise ManageError(f"forward_methods: {type(owner).__name__} " + (f"(module {path!r}) " if path else "") +
                              f"has no method {method!r}")
        found.setdefault((id(owner), method), (owner, method))
    return list(found.values())


def _listed(names: list[str]) -> str:
    return ", ".join(map(repr, names[:8])) + (", ..." if len(names) > 8 else "")


def manage(module: nn.Module, model: str, *, client: Client | None = None, device: str | torch.device | None = None,
           dtype: torch.dtype | None = None, limit: int | str | None = None, units: list[str] | None = None,
           strict: bool = True, prefetch: bool | None = None, share: Managed | None = None,
           follow: bool = False, forward_methods: list[str] = (), progress: bool | None = None) -> Managed:
    """Fills `module` (built on the meta device) from a lease of vramd's model `model` and manages
    its weights: see this module's text. `device`, `dtype` and `limit` default to the model's
    config ([vram] computation and limit), else the CPU, the leased dtype and no limit. `prefetch`
    (bring the next unit in while one computes) defaults to on a GPU only. `share`: a module
    managed already, whose limit (and device, and reservation) this one shares: their copies
    count together under it, and each drops the other's idle units to make room, as a pipeline's
    models run one after another. `follow`: take each new version of the weights an update makes,
    with Managed.wait_update() between forwards. `forward_methods`: the module's methods other than
    forward that run it as a forward does ("decode", "encode" of a VAE; "decoder.forward" for a
    submodule's), as FSDP's register_fsdp_forward_method names them: wait_update() takes a version
    between their calls too (any other call is waited for unit by unit only). `progress`: say each
    step on standard error as it is taken (the lease, the units planned, the page-locking, the
    hooks; default: when standard error is a terminal); they are logged at INFO on the "vramd"
    logger either way. Raises ManageError naming what does not fit, and vramd.DaemonError for the
    daemon's refusals (507 when the limit does not fit the device's budget)."""
    room = _shared_room(share, device, limit) if share is not None else None
    own_client = client is None
    client = client or connect()
    told = _Told(model, progress)
    try:
        told(f"leasing from vramd at {client.socket_path}")
        plan = client.lease_plan(model)
        device = room.device if room else _device(device or plan.get("device") or "cpu")
        limit = room.limit if room else parse_size(limit) if limit is not None else plan.get("limit")
        # The limit is held in the daemon's budget for the device while the lease lasts (a shared
        # one by the lease of the module that set it).
        reserve = (str(device), limit) if limit is not None and room is None else None
        lease = client.lease(model, device="cpu", reserve=reserve, follow=follow)
        told(f"leased {len(lease.state_dict)} tensors, {format_bytes(lease.manifest['bytes'])} resting in the daemon's "
             "memory" + (f", {format_bytes(limit)} of {device} reserved" if reserve else ""))
        if dtype is None:
            floating = {t.dtype for t in lease.state_dict.values() if t.is_floating_point()}
            dtype = getattr(torch, plan["dtype"]) if plan.get("dtype") else floating.pop() if len(floating) == 1 else None
            if dtype is None:
                lease.close()
                raise ManageError(f"model {model!r} rests in {len(floating)} floating dtypes and names no computation "
                                  "dtype: give dtype=")
        try:
            return Managed(module, lease, device, dtype, limit, units, strict,
                           device.type == "cuda" if prefetch is None else prefetch, room, forward_methods, told)
        except BaseException:
            lease.close()
            raise
    finally:
        if own_client:
            client.close()


def _device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def _shared_room(share, device, limit) -> _Room:
    """The limit `share` (what manage() returned) set, for another module to join."""
    if not isinstance(share, Managed):
        raise ManageError(f"share= takes a module managed already (what vramd.manage returned), not a "
                          f"{type(share).__name__}")
    room = share._room
    if share not in room.members:
        raise ManageError(f"share=: {share!r} has been closed, and its limit with it")
    if limit is not None:
        raise ManageError(f"give limit= or share=, not both: a module sharing the limit of {share!r} "
                          "counts its copies under that limit")
    if device is not None and _device(device) != room.device:
        raise ManageError(f"share=: the limit of {share!r} is on {room.device}, not {_device(device)}: a shared "
                          "limit holds the copies of modules computing on one device")
    return room
