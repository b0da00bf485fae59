"""vramd.manage: any nn.Module built on the meta device, filled from a lease of a model served as
`architecture = "weights"` whose weights rest in host memory in a dtype of their own (bfloat16,
float8, a GGUF file's blocks packed), each unit's weights brought to the computation device
right before it runs under a limit below the model's size. Witness: the same module loaded whole
with the same dtypes (the weights rounded through the resting dtype, or unpacked by the `gguf`
package, computed in float32), bit for bit. Also the limit counted by the manager, prefetching,
errors that name what does not fit, and the room a lease holds in the daemon's budget for its
client (freed when the client dies)."""
import concurrent.futures
import io
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save, save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests" / "daemon"))
import vramd  # noqa: E402
from daemon_support import Daemon, get_json, request, vramctl, wait_for  # noqa: E402

REST = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Toy(nn.Module):
    """A module of the user's own: a shared block called twice a forward, a head tied to the
    embeddings, a parameter held by the top module itself, a persistent buffer."""

    def __init__(self, d=32, vocabulary=50, blocks=4):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(blocks)])
        self.shared = Block(d)
        self.head = nn.Linear(d, vocabulary, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(d))
        self.register_buffer("offset", torch.zeros(d))

    def forward(self, ids):
        x = self.embed(ids) * self.scale + self.offset
        x = self.shared(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.shared(x))


class Refused(Exception):
    pass


class Faulty(nn.Linear):
    """A Linear that raises what it is given inside its forward: an error, or Ctrl-C's KeyboardInterrupt."""

    def forward(self, x, fault=None):
        if fault is not None:
            raise fault
        return super().forward(x)


class Chain(nn.Module):
    def __init__(self, width=16, units=8):
        super().__init__()
        self.layers = nn.ModuleList([Faulty(width, width) for _ in range(units)])

    def forward(self, x, fault_at=None, fault=None):
        for i, layer in enumerate(self.layers):
            x = layer(x, fault if i == fault_at else None)
        return x


def rounded(model, rest):
    """`model` with every floating weight rounded through `rest` and back: what a module computing
    in float32 from weights resting in `rest` holds (buffers left out of the checkpoint, such as
    a DiT's positions, are the module's own)."""
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(rest).to(tensor.dtype))
    return model


def weights_bytes(model):
    return sum(t.numel() * 4 for t in {id(p): p for p in model.parameters()}.values())


def largest_unit(model):
    return max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())


def leases_end(daemon, *names):
    """Waits for every lease of each model to end (their connections closed)."""
    for name in names:
        wait_for(lambda: get_json(daemon["sock"], f"/v1/models/{name}")["leases"] == [], what=f"{name}'s leases to end")


def served(folder, rest, limit):
    return (f'checkpoint = "{folder}"\narchitecture = "weights"\ndtype = "float32"\n'
            f'[vram]\nonload = {{ device = "cpu", dtype = "{rest}" }}\nlimit = {limit}\n')


GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# The float16 scale fields of the K types, which the gguf package cannot quantize into: random
# blocks with these set to small scales hold finite values.
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_blocks(kind, values, rng):
    """`values` (float32 [rows, columns]) as the bytes of GGUF type `kind`: quantized by the gguf
    package where it can, else random blocks with small scales."""
    import gguf
    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in K_SCALES:
        return gguf.quants.quantize(values, qtype)
    elements, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (values.size // elements, size), dtype=np.uint8)
    for offset in K_SCALES[kind]:
        blocks[:, offset:offset + 2] = rng.uniform(0.001, 0.01, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(values.shape[0], -1)


def write_gguf(toy, path):
    """The toy's weights as a GGUF file, its matrices in each block type in turn and the rest in
    float32; returns the state dict a whole module loads: the blocks' values as the gguf package
    unpacks them."""
    import gguf
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "toy")
    values, kinds = {}, {}
    for name, tensor in toy.state_dict().items():
        if name == "head.weight":
            continue
        array = tensor.numpy()
        if array.ndim == 2:
            kinds[name] = kind = GGUF_TYPES[len(kinds) % len(GGUF_TYPES)]
            blocks = gguf_blocks(kind, array, rng)
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
            array = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(name, array)
        values[name] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values, kinds


def diffusers_cases():
    diffusers = pytest.importorskip("diffusers")
    return {
        "unet": lambda: diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8),
        "sd3": lambda: diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=16),
        "dit": lambda: diffusers.DiTTransformer2DModel(  # latents of "vae" below: 4 channels, 8 x 8
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
            patch_size=2),
        "vae": lambda: diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4, norm_num_groups=8,
            sample_size=16),
    }


def transformers_case():
    transformers = pytest.importorskip("transformers")
    # OPT: an architecture vramd has no family for.
    return lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=32, word_embed_proj_dim=32))


def hub_layout_cases():
    """Mixtures of experts whose checkpoints transformers 5 converts as it loads them: Mixtral's,
    Qwen2-MoE's, Qwen3-MoE's and OLMoE's experts one tensor each (stacked and concatenated),
    GraniteMoE's renamed; and a Nomic BERT's fused Wqkv (chunked)."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2)
    # 12 experts: stacked in their numbers' order, not their names' (experts.10 after experts.9).
    qwen = dict(vocab_size=64, hidden_size=16, intermediate_size=8, moe_intermediate_size=8,
                shared_expert_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                num_experts=12, num_experts_per_tok=3)
    # Nomic's BERT: q, k and v stored fused in one Wqkv, which transformers chunks in three.
    nomic = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                 max_position_embeddings=32)
    # Qwen3-MoE (q and k normed per head, experts of their own size) and OLMoE (q and k normed
    # whole), each stacked as Mixtral's are, with sizes of their own (rows of a multiple of 16
    # bytes: transformers computes their experts with torch._grouped_mm, which needs them).
    qwen3 = dict(vocab_size=80, hidden_size=24, intermediate_size=16, moe_intermediate_size=12, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=6, num_experts=5, num_experts_per_tok=2)
    olmoe = dict(vocab_size=72, hidden_size=28, intermediate_size=20, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)
    return {"mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(**sizes)),
            "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**qwen3)),
            "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**olmoe)),
            "granitemoe": lambda: transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(**sizes)),
            "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**qwen)),
            "nomic_bert": lambda: transformers.NomicBertModel(transformers.NomicBertConfig(**nomic))}


# Hub-layout cases also served with converter = "transformers": stacked and joined experts,
# renames, and a chunk.
TRANSFORMERS_CONVERTED = ("mixtral", "granitemoe", "nomic_bert")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    folder = tmp_path_factory.mktemp("manage")
    # The Python that writes converter = "transformers": this one, with vramd and transformers;
    # the shipped converters, as configs/vramd.toml names them (gguf.lua).
    d = Daemon(folder, extra=f'python = "{sys.executable}"\nconverters = ["{ROOT / "scripts" / "converters"}"]',
               budgets='cpu = "2GiB"')
    references = {}
    torch.manual_seed(0)
    toy = Toy().eval()
    with torch.no_grad():
        toy.offset.normal_()
    save_file({k: v for k, v in toy.state_dict().items() if k != "head.weight"}, folder / "toy.safetensors")
    for rest in REST:
        (d.models / f"toy-{rest}.toml").write_text(served(folder / "toy.safetensors", rest, weights_bytes(toy) // 3))
        references[f"toy-{rest}"] = Toy().eval()
        references[f"toy-{rest}"].load_state_dict({k: v.to(REST[rest]).float() for k, v in toy.state_dict().items()})
    torch.manual_seed(3)
    chain = Chain().eval()
    save_file(chain.state_dict(), folder / "chain.safetensors")
    (d.models / "chain.toml").write_text(served(folder / "chain.safetensors", "bfloat16", 3 * largest_unit(chain)))
    references["chain"] = rounded(chain, torch.bfloat16)
    # A GGUF file of the toy's own names, at rest packed (packed is "auto": the limit) or unpacked.
    big = Toy(d=256).eval()
    values, kinds = write_gguf(big, folder / "toy.gguf")
    for name, packed in (("toy-gguf", ""), ("toy-gguf-unpacked", "packed = false, ")):
        (d.models / f"{name}.toml").write_text(
            f'checkpoint = "{folder / "toy.gguf"}"\narchitecture = "weights"\ndtype = "float32"\n'
            f'[vram]\nonload = {{ device = "cpu", {packed}dtype = "float32" }}\noffload = {{ device = "disk" }}\n'
            f'limit = {weights_bytes(big) // 3}\n')
    references["toy-gguf"] = Toy(d=256).eval()
    references["toy-gguf"].load_state_dict(values, strict=False)
    makers = {**diffusers_cases(), "opt": transformers_case()}
    for name, make in makers.items():
        torch.manual_seed(1)
        model = make().eval()
        model.save_pretrained(folder / name, safe_serialization=True)
        limit = max(weights_bytes(model) // 3, 2 * largest_unit(model))
        (d.models / f"{name}.toml").write_text(served(folder / name, "bfloat16", limit))
        references[name] = rounded(model, torch.bfloat16)
    for name, make in hub_layout_cases().items():  # saved as transformers saves them: the Hub's layout
        torch.manual_seed(2)
        model = make().eval()
        model.save_pretrained(folder / name, safe_serialization=True)
        (d.models / f"{name}.toml").write_text(served(folder / name, "float32", 1 << 20))
        # And with the converter written from transformers' own rules, under a limit below its size.
        written = subprocess.run([sys.executable, "-m", "vramd.transformers_converter", folder / name, "-o",
                                  folder / f"{name}.lua"], capture_output=True, text=True, cwd=ROOT / "python")
        assert written.returncode == 0, written.stderr
        limit = max(weights_bytes(model) // 3, 2 * largest_unit(model))
        (d.models / f"{name}-converted.toml").write_text(
            f'converter = "{folder / f"{name}.lua"}"\n' + served(folder / name, "float32", limit))
        references[f"{name}-converted"] = (limit, weights_bytes(model))
        if name in TRANSFORMERS_CONVERTED:  # the daemon runs that Python itself
            (d.models / f"{name}-transformers.toml").write_text('converter = "transformers"\n' +
                                                                served(folder / name, "float32", limit))
    with d.start():
        yield {"daemon": d, "sock": d.sock, "folder": folder, "references": references, "makers": makers,
               "gguf": kinds, "gguf_values": values}


def empty(make):
    from accelerate import init_empty_weights
    with init_empty_weights():
        model = make().eval()
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


@pytest.mark.parametrize("rest", list(REST))
def test_a_module_of_ones_own_equals_the_whole_module_and_keeps_its_limit(daemon, rest):
    with torch.device("meta"):
        model = Toy().eval()
    reference = daemon["references"][f"toy-{rest}"]
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(2))
    # On the CPU a thread prefetches only when asked: the hooks copy otherwise (docs/benchmarks.md).
    with vramd.connect(daemon["sock"]) as client, \
            vramd.manage(model, f"toy-{rest}", client=client, prefetch=True) as managed:
        assert managed.dtype == torch.float32 and managed.limit == weights_bytes(Toy()) // 3  # from the config
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(ids), reference(ids))
        stats = managed.stats()
        assert 0 < stats["peak"] <= stats["limit"], stats
        assert stats["loads"] > stats["units"]  # it could not keep them all: some came in more than once
        assert stats["prefetch_hits"] > 0 and stats["prefetched"] >= stats["prefetch_hits"], stats
        assert 0 <= stats["waited_seconds"] <= stats["hook_seconds"], stats  # the waits are the hooks'
        assert stats["bytes_read"] * (4 // REST[rest].itemsize) == stats["bytes_moved"], stats  # read at rest, cast
        # The room it uses is held in the daemon's budget, beside the weights at rest.
        status = get_json(daemon["sock"], "/v1/status")
        lease = next(m for m in status["models"] if m["name"] == f"toy-{rest}")
        resting = lease["devices"]["cpu"]
        assert status["devices"]["cpu"]["models"][f"toy-{rest}"] == resting + stats["limit"]
        # Its client tells the daemon its peak as it grows (a line per 1/64 of the limit at most).
        said = lambda: get_json(daemon["sock"], f"/v1/models/toy-{rest}")["leases"][0]["peak"] or 0  # noqa: E731
        wait_for(lambda: said() >= stats["peak"] - stats["limit"] // 64, what="the client's peak to be heard")
        assert said() <= stats["peak"]
        printed = vramctl(daemon["sock"], "status").stdout
        assert f"reserves cpu " in printed and ", peak " in printed, printed
        metrics = request(daemon["sock"], "GET", "/metrics")[1].decode()
        assert f'vramd_lease_peak_bytes{{model="toy-{rest}",pid="{os.getpid()}"}}' in metrics
    # Closed: the hooks are gone, the weights are meta again, the room is given back.
    assert all(p.is_meta for p in model.parameters())
    leases_end(daemon, f"toy-{rest}")


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_unit_that_raises_or_is_interrupted_lets_its_weights_go(daemon, prefetch):
    """A unit whose forward raises (a bad input, Ctrl-C) is no longer in use: it can be dropped,
    and the module goes on within its limit, though every unit has raised once."""
    with torch.device("meta"):
        model = Chain().eval()
    reference = daemon["references"]["chain"]
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(4))
    with vramd.connect(daemon["sock"]) as client, \
            vramd.manage(model, "chain", client=client, prefetch=prefetch) as managed, torch.no_grad():
        assert managed.limit == 3 * largest_unit(Chain())  # three units of eight fit
        # Outside its unit's forward a weight not brought in is a placeholder: loud, and named.
        with pytest.raises(vramd.ManageError, match=r"'layers.0.weight' is managed by vramd on cpu in float32: it has "
                                                    r"values only while its unit runs, not for sum"):
            model.layers[0].weight.sum()
        # Saved, a state dict of placeholders would be a file without values: refused, named.
        with pytest.raises(vramd.ManageError, match=r"'layers.0.weight' is managed by vramd: its placeholder has no "
                                                    r"values to save"):
            torch.save(model.state_dict(), io.BytesIO())
        for unit in range(8):
            with pytest.raises(Refused):
                model(x, fault_at=unit, fault=Refused(unit))
        with pytest.raises(KeyboardInterrupt):
            model(x, fault_at=5, fault=KeyboardInterrupt())
        assert torch.equal(model(x), reference(x))
        stats = managed.stats()
        assert stats["peak"] <= stats["limit"] and stats["ready_units"] <= 3, stats
    assert all(p.is_meta for p in model.parameters())
    assert all(layer.forward.__func__ is Faulty.forward for layer in model.layers)  # its own forward again


@pytest.mark.parametrize("prefetch", [False, True])
def test_threads_sharing_a_module_wait_for_room_rather_than_fail(daemon, prefetch):
    """Four threads run one managed module under a limit of two of its units: a thread that needs
    room while the others' units are in use waits for one to end (room kept for a prefetch is
    given back), and every output is right."""
    with torch.device("meta"):
        model = Chain().eval()
    reference = daemon["references"]["chain"]
    inputs = [torch.randn(2, 16, generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
    with torch.no_grad():
        wanted = [reference(x) for x in inputs]
    failures, start = [], threading.Barrier(4)

    def forwards(x, want):
        start.wait()
        with torch.no_grad():  # grad mode is the thread's own
            for _ in range(100):
                try:
                    if not torch.equal(model(x), want):
                        failures.append("a wrong output")
                except Exception as e:  # noqa: BLE001 - reported below
                    failures.append(repr(e))

    with vramd.connect(daemon["sock"]) as client, \
            vramd.manage(model, "chain", client=client, prefetch=prefetch, limit=2 * largest_unit(Chain())) as managed:
        threads = [threading.Thread(target=forwards, args=pair) for pair in zip(inputs, wanted)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = managed.stats()
    assert failures == [], failures[:3]
    assert stats["peak"] <= stats["limit"], stats


@pytest.mark.parametrize("prefetch", [False, True])
def test_modules_sharing_one_limit_take_each_others_room_under_one_reservation(daemon, prefetch):
    """A pipeline's models run one after another: managed under one limit (share=), each takes the
    room the other's idle units hold, their copies together never pass it, and the daemon holds
    one reservation, which lasts until the last of them is closed."""
    with torch.device("meta"):
        toy, chain = Toy().eval(), Chain().eval()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(7))
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(7))
    references = daemon["references"]
    with torch.no_grad():
        wanted_toy, wanted_chain = references["toy-bfloat16"](ids), references["chain"](x)
    # The toy needs 8704 bytes at once (its top module's 256 around its largest unit's 8448); alone,
    # the chain would keep all of its 8704 under this limit.
    limit = 10000
    with vramd.connect(daemon["sock"]) as client, torch.no_grad():
        first = vramd.manage(toy, "toy-bfloat16", client=client, limit=limit, prefetch=prefetch)
        second = vramd.manage(chain, "chain", client=client, share=first, prefetch=prefetch)
        assert second.limit == limit and second.device == first.device
        for _ in range(3):
            assert torch.equal(toy(ids), wanted_toy)
            assert torch.equal(chain(x), wanted_chain)
            # Beside what the toy holds, the chain cannot keep all its units as it would alone.
            assert 0 < first.stats()["held"] <= limit and second.stats()["ready_units"] < 8
        for stats in (first.stats(), second.stats()):
            assert 0 < stats["peak"] <= limit and stats["held"] <= limit, stats
        assert first.stats()["loads"] > first.stats()["units"] and second.stats()["loads"] > 0
        # One reservation, the first module's: the second's lease reserves nothing.
        leases = {name: get_json(daemon["sock"], f"/v1/models/{name}")["leases"] for name in ("toy-bfloat16", "chain")}
        assert [lease["reserved"] for lease in leases["toy-bfloat16"]] == [{"cpu": limit}], leases
        assert [lease["reserved"] for lease in leases["chain"]] == [{}], leases
        status = get_json(daemon["sock"], "/v1/status")
        charged = status["devices"]["cpu"]["models"]
        resting = {m["name"]: m["devices"].get("cpu") for m in status["models"]}
        assert charged["toy-bfloat16"] == resting["toy-bfloat16"] + limit
        assert charged["chain"] == resting["chain"]
        # The first closed, the second runs on under the limit, still reserved for it.
        first.close()
        assert all(p.is_meta for p in toy.parameters())
        assert torch.equal(chain(x), wanted_chain)
        assert [lease["reserved"] for lease in get_json(daemon["sock"], "/v1/models/toy-bfloat16")["leases"]] == \
            [{"cpu": limit}]
        second.close()
        assert all(p.is_meta for p in chain.parameters())
        leases_end(daemon, "toy-bfloat16", "chain")


def test_what_cannot_share_a_limit_is_named(daemon):
    with torch.device("meta"):
        toy, chain = Toy().eval(), Chain().eval()
    with vramd.connect(daemon["sock"]) as client:
        with vramd.manage(chain, "chain", client=client) as first:
            with pytest.raises(vramd.ManageError, match=r"give limit= or share=, not both"):
                vramd.manage(toy, "toy-bfloat16", client=client, share=first, limit="1MiB")
            with pytest.raises(vramd.ManageError, match=r"share=: the limit of <vramd.Managed 'chain' on cpu in "
                                                        r"float32, 8 units, limit 3.19 KiB> is on cpu, not cuda:0"):
                vramd.manage(toy, "toy-bfloat16", client=client, share=first, device="cuda")
            with pytest.raises(vramd.ManageError, match=r"units '', 'blocks.0.up' run one inside another, so they need "
                                                        r"8.50 KiB \(8704 bytes\) at once in float32 on cpu, more than the "
                                                        r"limit of 3.19 KiB it shares with 'chain': raise the limit"):
                vramd.manage(toy, "toy-bfloat16", client=client, share=first)
            assert all(p.is_meta for p in toy.parameters())  # refused before anything changed
        with pytest.raises(vramd.ManageError, match=r"share=: <vramd.Managed 'chain'.*> has been closed"):
            vramd.manage(toy, "toy-bfloat16", client=client, share=first)
        with pytest.raises(vramd.ManageError, match=r"share= takes a module managed already .*, not a str"):
            vramd.manage(toy, "toy-bfloat16", client=client, share="chain")
    leases_end(daemon, "toy-bfloat16", "chain")


def test_under_autograd_the_gradient_is_right_and_the_limit_is_said_not_to_hold(daemon):
    with torch.device("meta"):
        model = Chain().eval()
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(6)).requires_grad_()
    with vramd.connect(daemon["sock"]) as client, vramd.manage(model, "chain", client=client) as managed:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                model(x)  # no graph: no warning
        with pytest.warns(UserWarning, match=rf"unit 'layers.0' runs under autograd with an input that requires "
                                             rf"grad, .* beyond the limit of {vramd.format_bytes(managed.limit)} "):
            model(x).sum().backward()
        got, x.grad = x.grad, None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x)  # said once
    daemon["references"]["chain"](x).sum().backward()
    assert torch.equal(got, x.grad)


class Tree(nn.Module):
    """A random module: Linear and LayerNorm leaves, some shared by several parents (so called from
    inside a named unit and from outside it), inner modules holding a weight of their own around
    the units under them, children called in any order, some more than once."""

    def __init__(self, rng, pool, depth=0):
        super().__init__()
        self.kids = nn.ModuleList()
        for _ in range(rng.randint(1, 3)):
            chance = rng.random()
            if pool and chance < 0.2:
                kid = rng.choice(pool)
            elif depth < 3 and chance < 0.5:
                kid = Tree(rng, pool, depth + 1)
            else:
                kid = nn.Linear(8, 8, bias=rng.random() < 0.5) if rng.random() < 0.7 else nn.LayerNorm(8)
                pool.append(kid)
            self.kids.append(kid)
        self.scale = nn.Parameter(torch.ones(8)) if rng.random() < 0.3 else None
        self.order = [rng.randrange(len(self.kids)) for _ in range(rng.randint(1, 4))]

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.kids[i](x))
        return x if self.scale is None else x * self.scale


def tree(seed):
    """Tree `seed`, some of its Linear weights tied, and the random draws that follow."""
    rng = random.Random(seed)
    pool = []
    model = Tree(rng, pool).eval()
    linears = [m for m in pool if isinstance(m, nn.Linear)]
    for _ in range(rng.randint(0, 2)):
        if len(linears) >= 2:
            a, b = rng.sample(linears, 2)
            b.weight = a.weight
    return model, rng


def test_random_modules_equal_the_whole_module_from_the_least_limit_up(daemon):
    """Eighty random modules, each under the least limit the manager says it needs, a third of the
    way from there to its size, and its size; with units named at random or not, prefetching or
    not: each equals the whole module bit for bit, within its limit."""
    references, told = {}, set()
    for seed in range(80):
        model, _ = tree(seed)
        torch.manual_seed(seed)
        with torch.no_grad():
            for tensor in model.parameters():
                tensor.normal_()
        once = {}  # a tied weight under its first name
        for name, tensor in model.state_dict(keep_vars=True).items():
            once.setdefault(id(tensor), (name, tensor.detach().clone()))
        save_file(dict(once.values()), daemon["folder"] / f"tree-{seed}.safetensors")
        size = sum(tensor.numel() * 4 for _, tensor in once.values())
        (daemon["daemon"].models / f"tree-{seed}.toml").write_text(
            served(daemon["folder"] / f"tree-{seed}.safetensors", "bfloat16", size))
        references[seed] = (rounded(model, torch.bfloat16), size)
    with vramd.connect(daemon["sock"]) as client, torch.no_grad():
        client.reload()
        for seed, (reference, size) in references.items():
            with torch.device("meta"):
                model, rng = tree(seed)
            names = [name for name, m in model.named_modules() if not isinstance(m, nn.ModuleList)]
            units = rng.sample(names, rng.randint(0, min(3, len(names)))) if rng.random() < 0.5 else None
            prefetch = rng.random() < 0.5
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
            with pytest.raises(vramd.ManageError, match=r"needs? (\d+ B|[0-9.]+ [KMG]iB \(\d+ bytes\))") as refused:
                vramd.manage(model, f"tree-{seed}", client=client, units=units, limit=1)
            told.add("nested" if "run one inside another" in str(refused.value) else "alone")
            found = re.search(r"needs? (?:(\d+) B|[0-9.]+ [KMG]iB \((\d+) bytes\))", str(refused.value))
            least = int(found.group(1) or found.group(2))
            for limit in (least, (2 * least + size) // 3, size):
                with vramd.manage(model, f"tree-{seed}", client=client, units=units, limit=limit,
                                  prefetch=prefetch) as managed:
                    assert managed.stats()["least_limit"] == least
                    for _ in range(3):
                        assert torch.equal(model(x), reference(x)), (seed, units, prefetch, limit)
                    assert managed.stats()["peak"] <= limit, (seed, units, prefetch, managed.stats())
    assert told == {"nested", "alone"}  # both refusals were met


def test_a_compiled_module_still_takes_each_units_weights_from_the_manager(daemon):
    """torch.compile (inductor) of a managed module: Dynamo breaks its graphs at each unit's hook,
    so the units run with the weights the manager brings at each call, never values captured in
    a graph while they were there."""
    with torch.device("meta"):
        model = Toy().eval()
    reference = daemon["references"]["toy-bfloat16"]
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(4))
    with vramd.connect(daemon["sock"]) as client, vramd.manage(model, "toy-bfloat16", client=client) as managed:
        compiled = torch.compile(model)
        with torch.no_grad():
            for _ in range(3):
                loads = managed.stats()["loads"]
                assert torch.equal(compiled(ids), reference(ids))
                assert managed.stats()["loads"] > loads  # its limit holds a third: units came in again
        assert 0 < managed.stats()["peak"] <= managed.limit

@pytest.mark.parametrize("name", ["toy-gguf", "toy-gguf-unpacked"])
def test_a_gguf_model_rests_packed_and_its_managed_module_equals_the_unpacked_one(daemon, name):
    """Under a limit a GGUF model's blocks rest packed ("auto"), as the file holds them, and each
    unit's are unpacked on the computation device as it comes; with packed = false they rest
    unpacked. Either way the module equals the whole one whose weights the gguf package
    unpacked, bit for bit, before and after the model has slept on disk and been woken."""
    import gguf
    sock, kinds, values = daemon["sock"], daemon["gguf"], daemon["gguf_values"]
    reference = daemon["references"]["toy-gguf"]
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(4))
    packed = name == "toy-gguf"
    with vramd.connect(sock) as client:
        for when in ("awake", "woken"):
            with torch.device("meta"):
                model = Toy(d=256).eval()
            with vramd.manage(model, name, client=client) as managed:
                with torch.no_grad():
                    for _ in range(2):
                        assert torch.equal(model(ids), reference(ids)), when
                stats = managed.stats()
                if packed:
                    assert 0 < stats["peak"] <= stats["limit"], stats
                    assert stats["loads"] > stats["units"], stats
                    assert stats["prefetched"] == 0 and not managed.prefetch, stats  # the CPU's default
                    assert 0 < stats["bytes_read"] * 3 < stats["bytes_moved"], stats  # blocks read, float32 made
                else:  # float32 at rest, computed in float32 on the CPU: views of the lease, no copies
                    assert stats["peak"] == 0 and stats["bytes_moved"] == 0, stats
                lease = managed.lease
                if packed:
                    assert {n: p.type for n, p in lease.packed.items()} == kinds
                    for n, p in lease.packed.items():
                        assert lease.state_dict[n].dtype == torch.uint8 and p.shape == tuple(values[n].shape)
                        assert torch.equal(vramd.unpack(lease.state_dict[n], *p), values[n]), n
                    # At rest once: views of the checkpoint's page cache, nothing copied.
                    assert [(r["kind"], r.get("path")) for r in lease.manifest["regions"]] == \
                        [("file", str(daemon["folder"] / "toy.gguf"))]
                else:
                    assert lease.packed == {}
                    assert all(t.dtype == torch.float32 for t in lease.state_dict.values())
                units = {u["name"]: u for u in lease.manifest["plan"]["units"]}
                assert units["blocks.0.up"]["computed"] == (512 * 256 + 512) * 4
                elements, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kinds["blocks.0.up.weight"]]]
                weight = 512 * 256 // elements * size if packed else 512 * 256 * 4
                assert units["blocks.0.up"]["resting"] == weight + 512 * 4  # and the bias, in float32
                held = get_json(sock, f"/v1/models/{name}")["devices"]["cpu"]
                unpacked = sum(v.nbytes for v in values.values())
                assert held == lease.manifest["bytes"]
                assert held < unpacked // 3 if packed else held == unpacked
            # offload waits for the lease to end, then releases the weights to disk; the next lease wakes it
            assert client.offload(name)["moved"]["bytes"] == held


def test_unpack_equals_the_gguf_package_on_random_blocks_of_every_type(monkeypatch):
    """Every bit of every field, scales of any value (NaN and infinity too): the same float32 bits;
    and in bfloat16 those rounded once, unpacked in steps whose last one is short."""
    import gguf
    rng = np.random.default_rng(6)

    def same_bits(got, want, bits, kind):
        assert torch.equal(got.isnan(), want.isnan()), kind
        assert torch.equal(got[~got.isnan()].view(bits), want[~want.isnan()].view(bits)), kind

    for kind in GGUF_TYPES:
        qtype = gguf.GGMLQuantizationType[kind]
        elements, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (3, 1024 // elements * size), dtype=np.uint8)
        with np.errstate(all="ignore"):
            want = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
        same_bits(vramd.unpack(torch.from_numpy(blocks), kind, (3, 1024)), want, torch.int32, kind)
        with monkeypatch.context() as patch:  # 1280 elements a step: 5 K blocks (of 12), 40 others (of 96)
            patch.setattr(vramd._gguf, "_CPU_STEP_ELEMENTS", 1280)
            for dtype in (torch.float32, torch.bfloat16):
                got = vramd.unpack(torch.from_numpy(blocks), kind, (3, 1024), dtype)
                same_bits(got, want.to(dtype), torch.int32 if dtype == torch.float32 else torch.int16, kind)
            default = torch.get_default_dtype()
            try:  # a process whose default dtype is bfloat16 still unpacks in float32
                torch.set_default_dtype(torch.bfloat16)
                same_bits(vramd.unpack(torch.from_numpy(blocks), kind, (3, 1024), torch.bfloat16),
                          want.to(torch.bfloat16), torch.int16, kind)
            finally:
                torch.set_default_dtype(default)
    with pytest.raises(ValueError, match=r"'Q1_0' is not a GGUF type vramd unpacks"):
        vramd.unpack(torch.zeros(2, 18, dtype=torch.uint8), "Q1_0", (2, 32))
    with pytest.raises(ValueError, match=r"Q4_0 blocks of shape \[2, 17\] in torch.uint8 do not unpack into \[2, 32\]"):
        vramd.unpack(torch.zeros(2, 17, dtype=torch.uint8), "Q4_0", (2, 32))


def test_a_gguf_model_resting_packed_is_counted_packed_and_fits_a_budget_its_values_would_not(daemon, tmp_path):
    """Its budget holds the packed bytes (0.85 MiB here) and a client's limit (1 MiB), not its
    values in float32 (5.08 MiB)."""
    small = Daemon(tmp_path / "small", budgets='cpu = "3MiB"')
    (small.models / "toy.toml").write_text(
        f'checkpoint = "{daemon["folder"] / "toy.gguf"}"\narchitecture = "weights"\ndtype = "float32"\n'
        '[vram]\nonload = { device = "cpu", dtype = "float32" }\nlimit = "1MiB"\n')
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(4))
    with small.start(), vramd.connect(small.sock) as client:
        with torch.device("meta"):
            model = Toy(d=256).eval()
        with vramd.manage(model, "toy", client=client) as managed, torch.no_grad():
            assert torch.equal(model(ids), daemon["references"]["toy-gguf"](ids))
            used = get_json(small.sock, "/v1/status")["devices"]["cpu"]
            assert used["models"]["toy"] == managed.lease.manifest["bytes"] + (1 << 20) <= used["budget"], used


def test_a_gguf_model_kept_packed_without_a_limit_rests_for_its_clients_too(daemon, tmp_path):
    """packed = true is a [vram] table that streams, as a limit is: the plan says so."""
    checkpoint = daemon["folder"] / "toy.gguf"
    for packed, plan in (("packed = true", "plan: rests in host memory in float32 and packed GGUF blocks (868.03 KiB) "
                                           "for the clients that manage it: 17 units, the largest 514.00 KiB in float32 "
                                           "on cpu\n"),
                         ("packed = false", None)):  # nothing streams: a model leased whole, no plan
        config = tmp_path / "toy.toml"
        config.write_text(f'checkpoint = "{checkpoint}"\narchitecture = "weights"\ndtype = "float32"\n'
                          f'[vram]\nonload = {{ device = "cpu", {packed} }}\n')
        checked = subprocess.run([os.environ["VRAMCTL"], "check", "--daemon-config", daemon["daemon"].config, config],
                                 capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert plan in checked.stdout if plan else "plan:" not in checked.stdout, checked.stdout


def test_an_update_of_a_weight_resting_packed_is_refused_naming_it(daemon):
    sock, kinds = daemon["sock"], daemon["gguf"]
    weight = next(iter(kinds))
    shape = tuple(daemon["gguf_values"][weight].shape)
    with vramd.connect(sock) as client:
        client.load("toy-gguf")
        with pytest.raises(vramd.DaemonError, match=rf"model 'toy-gguf' holds '{weight}' as packed GGUF blocks, which "
                                                    r"take no update of plain values: keep them unpacked \(packed = "
                                                    r"false\) to update it") as refused:
            client.update("toy-gguf", {weight: torch.zeros(shape)})
        assert refused.value.status == 409
        # Nothing changed: a lease holds the file's blocks.
        with client.lease("toy-gguf") as state_dict:
            assert torch.equal(vramd.unpack(state_dict[weight], kinds[weight], shape), daemon["gguf_values"][weight])
        # The weights that rest unpacked (a norm, F32 in the file) take updates as ever.
        norm = daemon["gguf_values"]["blocks.0.norm.weight"]
        client.update("toy-gguf", {"blocks.0.norm.weight": norm * 2})
        with client.lease("toy-gguf") as state_dict:
            assert torch.equal(state_dict["blocks.0.norm.weight"], norm * 2)
        client.update("toy-gguf", {"blocks.0.norm.weight": norm})  # as the other tests expect it


class Normed(nn.Module):
    """Convolutions with BatchNorm: running statistics as float buffers, num_batches_tracked as int64."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3),
                                    nn.BatchNorm2d(4))

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU here: a managed module on a GPU following updates not run")])])
def test_a_managed_module_following_updates_takes_each_version_between_forwards(daemon, tmp_path, device):
    """An RL loop's policy larger than its device: managed with follow=True, it computes on the
    version it has until wait_update() takes the next one (on a GPU, the new version's host memory
    page-locked in place of the one before); a module not following keeps the version before
    until it is closed."""
    name = f"policy-{device.split(':')[0]}"
    torch.manual_seed(9)
    toy = Toy().eval()
    state = {k: v for k, v in toy.state_dict().items() if k != "head.weight"}
    save_file(state, tmp_path / "policy.safetensors")
    (daemon["daemon"].models / f"{name}.toml").write_text(
        served(tmp_path / "policy.safetensors", "bfloat16", weights_bytes(toy) // 3))

    def reference(values):
        model = Toy().eval()
        model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in values.items()}, strict=False)
        return model.to(device)

    changed = {"embed.weight": torch.randn(50, 32), "blocks.2.up.bias": torch.randn(64), "scale": torch.rand(32)}
    before, after = reference(state), reference({**state, **changed})
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(9)).to(device)
    with torch.device("meta"):
        policy, old = Toy().eval(), Toy().eval()
    with vramd.connect(daemon["sock"]) as client, torch.no_grad():
        client.reload()
        with vramd.manage(policy, name, client=client, device=device, follow=True, prefetch=True) as managed, \
                vramd.manage(old, name, client=client, device=device) as not_following:
            version = managed.version
            assert torch.equal(policy(ids), before(ids))
            with pytest.raises(TimeoutError):
                managed.wait_update(timeout=0.2)  # nothing new yet
            assert client.update(name, changed)["version"] == version + 1
            assert torch.equal(policy(ids), before(ids))  # not taken yet: the version it has
            assert managed.wait_update(timeout=60) == version + 1 == managed.version
            for _ in range(2):
                assert torch.equal(policy(ids), after(ids))
                assert torch.equal(old(ids), before(ids))
            stats = managed.stats()
            assert 0 < stats["peak"] <= stats["limit"] and stats["units"] == 18, stats
            assert (stats["pinned_bytes"] > 0) == (device != "cpu"), stats  # the new version's, page-locked
            # From inside a forward (the top module's unit is in use around the blocks): refused.
            hook = policy.blocks[1].register_forward_pre_hook(lambda *_: managed.wait_update(timeout=0.2))
            with pytest.raises(vramd.ManageError, match=r"wait_update\(\) of <vramd.Managed 'policy-\w+' .*> from inside "
                                                        r"its forward: call it between forwards"):
                policy(ids)
            hook.remove()
            with pytest.raises(vramd.ManageError, match=r"<vramd.Managed 'policy-\w+' .*> does not follow updates: manage "
                                                        r"it with follow=True"):
                not_following.wait_update(timeout=0.2)
            assert torch.equal(policy(ids), after(ids))


class Coder(nn.Module):
    """A chain holding no weights of its own (no unit in use between two of its layers), reached
    by forward, by a method of its own (as a VAE's decode) and through its submodule."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))

    def forward(self, x):
        return self.decoder(x)

    def decode(self, x):
        return self.decoder(x) * 2


ENTRIES = {"forward": lambda coder: coder, "decode": lambda coder: coder.decode,
           "decoder.forward": lambda coder: coder.decoder}


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_version_is_taken_between_forwards_of_other_threads_never_inside_one(daemon, tmp_path, entry):
    """A rollout thread's call paused between two layers of a chain while an updater thread calls
    wait_update(): the version is not taken inside that call, which ends on the version it began
    with; a call that would begin while the updater waits waits for it, and runs on the new
    version. The call is the module's forward, or an entry point named in forward_methods (a
    method of the module's, a submodule's forward)."""
    torch.manual_seed(13)
    coder = Coder().eval()
    save_file(coder.state_dict(), tmp_path / "coder.safetensors")
    (daemon["daemon"].models / "rollout.toml").write_text(served(tmp_path / "coder.safetensors", "float32",
                                                               weights_bytes(coder) // 2))
    changed = {"decoder.2.weight": torch.randn(16, 16), "decoder.3.bias": torch.randn(16)}
    after = Coder().eval()
    after.load_state_dict({**coder.state_dict(), **changed})
    before_call, after_call = ENTRIES[entry](coder), ENTRIES[entry](after)
    x = torch.randn(3, 16)
    with torch.device("meta"):
        managed_coder = Coder().eval()
    paused, go = threading.Event(), threading.Event()

    def pause(*_):
        if not go.is_set():
            paused.set()
            go.wait(120)

    with vramd.connect(daemon["sock"]) as client, torch.no_grad():
        client.reload()
        methods = [] if entry == "forward" else [entry]
        with vramd.manage(managed_coder, "rollout", client=client, follow=True, forward_methods=methods) as managed:
            call = ENTRIES[entry](managed_coder)
            version = managed.version
            assert torch.equal(call(x), before_call(x))
            hook = managed_coder.decoder[2].register_forward_pre_hook(pause)
            threads = concurrent.futures.ThreadPoolExecutor(3)
            try:
                rollout = threads.submit(call, x)
                assert paused.wait(60)  # between layers 1 and 2, on the version it began with
                assert client.update("rollout", changed)["version"] == version + 1
                with pytest.raises(TimeoutError, match=r"version \d+ of 'rollout' came, but the forwards under way on "
                                                       r"other threads did not end within 0.5 s"):
                    threads.submit(managed.wait_update, 0.5).result(timeout=60)
                assert managed.version == version
                updater = threads.submit(managed.wait_update, 60)  # waits for the paused call
                wait_for(lambda: managed._taking == 1, what="the updater to wait for the call under way")
                later = threads.submit(call, x)  # begins once the updater has taken the version
                go.set()
                assert torch.equal(rollout.result(timeout=60), before_call(x))  # one version throughout
                assert updater.result(timeout=60) == version + 1 == managed.version
                assert torch.equal(later.result(timeout=60), after_call(x))
            finally:
                go.set()  # a failure above leaves no thread paused
                threads.shutdown()
            hook.remove()
            assert torch.equal(call(x), after_call(x))
            # From a hook inside the call, between units: refused, not waited for forever.
            hook = managed_coder.decoder[1].register_forward_pre_hook(lambda *_: managed.wait_update(timeout=0.2))
            with pytest.raises(vramd.ManageError, match=r"wait_update\(\) of <vramd.Managed 'rollout' .*> from inside its "
                                                        r"forward"):
                call(x)
            hook.remove()
        if entry == "decode":  # a name the module lacks: refused before the module changes
            for methods, named in ((["encode"], r"Coder has no method 'encode'"),
                                   (["decoder.5.forward"], r"Coder has no module 'decoder.5' \(in 'decoder.5.forward'\)"),
                                   (["decoder.__call__"], r"Sequential \(module 'decoder'\) has no method '__call__'"),
                                   ("decode", r"takes a list of method names, not the string 'decode'")):
                with pytest.raises(vramd.ManageError, match=named):
                    vramd.manage(managed_coder, "rollout", client=client, forward_methods=methods)
                assert all(p.is_meta for p in managed_coder.parameters()) and "decode" not in vars(managed_coder)
            leases_end(daemon, "rollout")


def test_integer_tensors_rest_as_they_are_and_take_no_update(daemon, tmp_path):
    """Architecture "weights" holds a checkpoint's integer tensors (BatchNorm's num_batches_tracked)
    as the checkpoint has them, whatever the states' dtype: leased and managed as int64, and no
    update casts values into them."""
    torch.manual_seed(5)
    model = Normed().eval()
    with torch.no_grad():
        for norm in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2)
            norm.num_batches_tracked.fill_(7)
    save_file(model.state_dict(), tmp_path / "normed.safetensors")
    (daemon["daemon"].models / "normed.toml").write_text(
        served(tmp_path / "normed.safetensors", "bfloat16", 3 * largest_unit(model) // 2))
    reference = rounded(model, torch.bfloat16)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    with vramd.connect(daemon["sock"]) as client:
        client.reload()
        with client.lease("normed") as state_dict:
            counted = state_dict["layers.1.num_batches_tracked"]
            assert counted.dtype == torch.int64 and counted.item() == 7
            assert state_dict["layers.1.running_var"].dtype == torch.bfloat16
            # The plan counts each unit as a client computes it: integers in their own dtype.
            norm = {unit["name"]: unit for unit in client.lease_plan("normed")["units"]}["layers.1"]
            assert norm["computed"] == sum(state_dict[name].numel() * (8 if name.endswith("tracked") else 4)
                                           for name in norm["tensors"]), norm
        with torch.device("meta"):
            managed_model = Normed().eval()
        with torch.no_grad(), vramd.manage(managed_model, "normed", client=client) as managed:
            assert torch.equal(managed_model(x), reference(x))
            assert torch.equal(managed_model(x), reference(x))
            stats = managed.stats()
            assert 0 < stats["peak"] <= managed.limit and stats["loads"] > stats["units"], stats
        with pytest.raises(vramd.DaemonError, match=r"model 'normed' holds 'layers.1.num_batches_tracked' as Long "
                                                    r"values as the checkpoint has them, which take no update") as refused:
            client.update("normed", {"layers.1.num_batches_tracked": torch.tensor(9.0)})
        assert refused.value.status == 409
        client.update("normed", {"layers.1.running_mean": torch.zeros(8)})  # its floating weights do
        with client.lease("normed") as state_dict:
            assert state_dict["layers.1.num_batches_tracked"].item() == 7
            assert not state_dict["layers.1.running_mean"].any()


def test_a_move_of_a_module_around_a_shared_unit_by_any_path_is_refused_before_anything_changes(daemon, tmp_path):
    """A Linear shared by two parents is one unit with two paths: a cast of the second parent is
    refused before it reaches the module beside the Linear (whose buffer of its own stays float32)."""
    torch.manual_seed(6)
    linear = nn.Linear(8, 8)
    save_file({f"a.0.{k}": v for k, v in linear.state_dict().items()}, tmp_path / "shared.safetensors")
    (daemon["daemon"].models / "shared.toml").write_text(
        served(tmp_path / "shared.safetensors", "bfloat16", largest_unit(linear)))
    with torch.device("meta"):
        shared = nn.Linear(8, 8)
        model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(nn.Module(), shared)})
    model.b[0].register_buffer("steps", torch.zeros(2))  # the user's own, not leased
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    with vramd.connect(daemon["sock"]) as client:
        client.reload()
        with torch.no_grad(), vramd.manage(model, "shared", client=client):
            for parent in (model, model.a, model.b):
                with pytest.raises(vramd.ManageError, match=r"'a.0.(weight|bias)' is managed by vramd on cpu in "
                                                            r"float32: it cannot be moved or cast to cpu in float64"):
                    parent.double()
                assert model.b[0].steps.dtype == torch.float32
            assert torch.equal(model.b[1](x), rounded(linear, torch.bfloat16)(x))


@pytest.mark.parametrize("name", ["unet", "sd3", "vae", "opt"])
def test_diffusers_and_transformers_models_equal_the_whole_model(daemon, name):
    reference = daemon["references"][name]
    model = empty(daemon["makers"][name])
    g = torch.Generator().manual_seed(3)
    with torch.no_grad(), vramd.connect(daemon["sock"]) as client, vramd.manage(model, name, client=client) as managed:
        for _ in range(2):
            if name == "unet":
                sample, states = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 5, 32, generator=g)
                got, want = model(sample, 10, states).sample, reference(sample, 10, states).sample
            elif name == "sd3":
                args = dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g), timestep=torch.tensor([10]),
                            encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
                            pooled_projections=torch.randn(1, 16, generator=g))
                got, want = model(**args).sample, reference(**args).sample
            elif name == "vae":  # an entry point other than forward
                latents = torch.randn(1, 4, 4, 4, generator=g)
                got, want = model.decode(latents).sample, reference.decode(latents).sample
            else:
                ids = torch.randint(0, 100, (2, 9), generator=g)
                got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
            assert torch.equal(got, want), (name, (got - want).abs().max())
        stats = managed.stats()
        assert 0 < stats["peak"] <= stats["limit"], stats


def test_a_diffusers_pipeline_on_managed_modules_equals_it_on_whole_ones(daemon):
    """DiTPipeline with its transformer and its VAE (whose entry point is decode) each managed under
    a limit below its size: the pipeline's .to(), device and dtype see where the modules compute,
    and its images equal those of the same pipeline on the whole modules, bit for bit."""
    diffusers = pytest.importorskip("diffusers")

    def images(transformer, vae):
        pipe = diffusers.DiTPipeline(transformer=transformer, vae=vae, scheduler=diffusers.DDIMScheduler())
        pipe.set_progress_bar_config(disable=True)
        pipe.to("cpu")  # as users write it: a managed module stays where it computes
        assert pipe.device == pipe._execution_device == torch.device("cpu")
        assert transformer.dtype == torch.float32
        with torch.no_grad():
            return pipe(class_labels=[1, 7], num_inference_steps=2, generator=torch.Generator().manual_seed(5),
                        output_type="np").images

    whole = images(daemon["references"]["dit"], daemon["references"]["vae"])
    transformer, vae = empty(daemon["makers"]["dit"]), empty(daemon["makers"]["vae"])
    with vramd.connect(daemon["sock"]) as client, vramd.manage(transformer, "dit", client=client) as managed, \
            vramd.manage(vae, "vae", client=client) as managed_vae:
        assert np.array_equal(images(transformer, vae), whole)
        for m in (managed, managed_vae):
            stats = m.stats()
            assert stats["peak"] <= stats["limit"] < stats["bytes_moved"], stats  # units came and went
        # A move or a cast the manager cannot honour is refused, naming a weight; the module is unharmed.
        with pytest.raises(vramd.ManageError, match=r"'[a-z_.0-9]+' is managed by vramd on cpu in float32: it cannot "
                                                    r"be moved or cast to cpu in float16"):
            transformer.to(torch.float16)
        assert np.array_equal(images(transformer, vae), whole)
    assert all(p.is_meta for p in transformer.parameters())


@pytest.mark.parametrize("share", [False, True])
def test_the_pipeline_example_runs_on_managed_modules_as_it_says(daemon, share):
    folder = daemon["folder"]
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "manage_pipeline.py"), "dit", str(folder / "dit"),
                             "vae", str(folder / "vae")] + ["--share"] * share, capture_output=True, text=True,
                            timeout=300,
                            env={**os.environ, "VRAMD_SOCKET": str(daemon["sock"]), "PYTHONPATH": str(ROOT / "python")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dit: DiTTransformer2DModel managed on cpu" in result.stdout, result.stdout
    if share:
        assert re.search(r"vae: AutoencoderKL managed on cpu, [0-9.]+ [KMG]iB at most under the limit of [0-9.]+ [KMG]iB "
                         r"it shares",
                         result.stdout), result.stdout
    assert "2 images equal to the pipeline's on the whole modules" in result.stdout, result.stdout


def test_manage_says_each_step_as_it_takes_it(daemon, capsys, caplog):
    # A large model's lease and hooks take seconds: each step is logged, and said on standard
    # error with progress=True (by default, when it is a terminal).
    with torch.device("meta"):
        chain = Chain()
    with caplog.at_level(logging.INFO, logger="vramd"), vramd.connect(daemon["sock"]) as client:
        with vramd.manage(chain, "chain", client=client, limit="4KiB", progress=True):
            said = capsys.readouterr().err.splitlines()
        steps = [re.sub(r" \(\d+\.\d\d s\)$", "", line) for line in said]
        assert steps == [
            f"vramd.manage: 'chain': leasing from vramd at {daemon['sock']}",
            "vramd.manage: 'chain': leased 16 tensors, 4.25 KiB resting in the daemon's memory, 4.00 KiB of cpu reserved",
            "vramd.manage: 'chain': 8 units, the largest 1.06 KiB in float32 on cpu, limit 4.00 KiB",
            "vramd.manage: 'chain': Chain managed"], said
        assert [r.getMessage() for r in caplog.records if r.name == "vramd"] == [line.removeprefix("vramd.manage: ")
                                                                               for line in said]
        with vramd.manage(chain, "chain", client=client, progress=False):
            assert capsys.readouterr().err == ""


def test_what_does_not_fit_is_named(daemon):
    sock = daemon["sock"]
    with vramd.connect(sock) as client:
        with torch.device("meta"):
            model = Toy(d=16)
        with pytest.raises(vramd.ManageError, match=r"does not fit Toy: 33 mismatched: 'scale' is \[32\] leased, \[16\] "
                                                    r"in the module, 'offset' is \[32\] leased, \[16\] in the module, "):
            vramd.manage(model, "toy-bfloat16", client=client)
        with torch.device("meta"):
            model = Toy(blocks=2)
        with pytest.raises(vramd.ManageError, match=r"12 leased tensors the module does not hold: 'blocks.2.down.bias'"):
            vramd.manage(model, "toy-bfloat16", client=client)
        with torch.device("meta"):
            model = Toy(blocks=5)
        with pytest.raises(vramd.ManageError, match=r"6 without a leased tensor: 'blocks.4.norm.weight'"):
            vramd.manage(model, "toy-bfloat16", client=client)
        with torch.device("meta"):
            model = Toy()
        # The top module's own weights are in use around every unit under it.
        with pytest.raises(vramd.ManageError, match=r"units '', 'blocks.0.up' run one inside another, so they need "
                                                    r"8.50 KiB \(8704 bytes\) at once in float32 on cpu, more than the "
                                                    r"limit of 1000 B: raise the limit$"):
            vramd.manage(model, "toy-bfloat16", client=client, limit=1000)
        with torch.device("meta"):
            chain = Chain()
        # Sizes as vramctl prints them, the one to meet to the byte exactly too.
        with pytest.raises(vramd.ManageError, match=r"unit 'layers.0' needs 1.06 KiB \(1088 bytes\) in float32 on cpu, "
                                                    r"more than the limit of 1000 B: raise the limit, or name smaller units"):
            vramd.manage(chain, "chain", client=client, limit=1000)
        assert all(p.is_meta for p in chain.parameters())  # refused, the module is as it was
        with pytest.raises(vramd.ManageError, match=r"unit 'blocks' is a ModuleList, which is never called \(only "
                                                    r"the modules it holds are\): name those"):
            vramd.manage(model, "toy-bfloat16", client=client, units=["blocks", "shared"])
        # Units given by name: each a module and everything under it.
        blocks = [f"blocks.{i}" for i in range(4)]
        with vramd.manage(model, "toy-bfloat16", client=client, units=blocks + ["shared"], limit="1MiB") as managed:
            assert managed.stats()["units"] == 8  # embed (with the tied head), 4 blocks, shared, head, the top module
            # Managed twice, its weights would be each manager's placeholders in turn.
            for again in (model, model.blocks[1]):  # the module, or a module of it
                with pytest.raises(vramd.ManageError, match=rf"{type(again).__name__} is managed already: "
                                                            r"'[A-Za-z]+', '[a-z]+', .* close\(\) it first"):
                    vramd.manage(again, "toy-bfloat16", client=client, strict=False)
            assert torch.equal(model(torch.tensor([[1, 2]])), model(torch.tensor([[1, 2]])))  # the first goes on
        # Every refusal left the daemon serving and no lease behind.
        leases_end(daemon, "toy-bfloat16")


@pytest.mark.parametrize("name", list(hub_layout_cases()))
def test_a_converter_written_from_transformers_rules_lets_its_module_be_managed(daemon, name):
    """The checkpoint above served with the converter vramd.transformers_converter wrote from
    transformers' rules: its managed module, under a limit below its size, equals transformers'
    own from_pretrained of the folder (float32)."""
    import transformers
    limit, size = daemon["references"][f"{name}-converted"]
    assert limit < size
    folder = daemon["folder"] / name
    reference = getattr(transformers, type(hub_layout_cases()[name]()).__name__).from_pretrained(
        folder, dtype=torch.float32).eval()
    inputs = torch.tensor([[1, 5, 9, 33, 2, 60, 7]])
    with vramd.connect(daemon["sock"]) as client:
        module = empty(hub_layout_cases()[name])
        with vramd.manage(module, f"{name}-converted", client=client, limit=limit) as managed, torch.no_grad():
            got = module(inputs)[0]  # logits, or a BERT's last hidden state
            assert managed.stats()["peak"] <= limit
    with torch.no_grad():
        expected = reference(inputs)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    leases_end(daemon, f"{name}-converted")


@pytest.mark.parametrize("name", list(hub_layout_cases()))
def test_transformers_own_conversion_is_applied_by_the_daemon_for_a_managed_module(daemon, name):
    """The checkpoint in the Hub's layout served as it is, with no converter: vramd.manage sends
    transformers' rules for the module's model type, the daemon derives a model that applies them,
    and the managed module, under a limit below its size, equals transformers' own from_pretrained
    of the folder (float32)."""
    import transformers
    limit, size = daemon["references"][f"{name}-converted"]
    assert limit < size
    reference = getattr(transformers, type(hub_layout_cases()[name]()).__name__).from_pretrained(
        daemon["folder"] / name, dtype=torch.float32).eval()
    inputs = torch.tensor([[3, 5, 9, 33, 2, 60, 7, 11]])
    with vramd.connect(daemon["sock"]) as client:
        leases_end(daemon, name)
        loads = client.unload(name)["stats"]["loads"]
        module = empty(hub_layout_cases()[name])
        with vramd.manage(module, name, client=client, limit=limit) as managed, torch.no_grad():
            derived = managed.lease.manifest["model"]
            got = module(inputs)[0]
            assert managed.stats()["peak"] <= limit
            # The base's names came from its plan: only the derived model was loaded.
            base = client.status(name)
            assert base["state"] == "unloaded" and base["stats"]["loads"] == loads, base
        entry = client.status(derived)
    assert derived.startswith(f"{name}.derived-") and entry["derived_from"] == name and entry["file"] == "", entry
    with torch.no_grad():
        expected = reference(inputs)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    leases_end(daemon, derived)


@pytest.mark.parametrize("name", ["toy-bfloat16", "toy-float8_e4m3fn", "toy-gguf", "toy-gguf-unpacked", "chain",
                                  "opt", "mixtral", "mixtral-converted"])
def test_the_plan_is_what_a_lease_hands_over_and_loads_nothing(daemon, name):
    """GET /v1/models/NAME/plan, from the config's check: the names a lease's manifest lists, in
    its order, and the plan it carries (resting bytes as held: cast, packed GGUF blocks), with
    the model not loaded for it."""
    with vramd.connect(daemon["sock"]) as client:
        leases_end(daemon, name)
        client.unload(name)
        loads = client.status(name)["stats"]["loads"]
        planned = client.plan(name)
        assert client.status(name)["state"] == "unloaded" and client.status(name)["stats"]["loads"] == loads
        lease = client.lease(name)
        with lease:
            manifest = lease.manifest
        assert planned == {"model": name, "names": [t["name"] for t in manifest["tensors"]], "plan": manifest["plan"]}
    leases_end(daemon, name)


def test_a_plan_of_what_is_not_a_model_is_refused(daemon):
    status, answer = request(daemon["sock"], "POST", "/v1/models/chain/plan")
    assert status == 405 and json.loads(answer)["error"] == "POST '/v1/models/chain/plan': use GET", answer
    status, answer = request(daemon["sock"], "GET", "/v1/models/nothing/plan")
    assert status == 404 and "no model named 'nothing'" in json.loads(answer)["error"], answer
    (daemon["daemon"].models / "broken.toml").write_text('checkpoint = "/nowhere.safetensors"\narchitecture = "weights"\n')
    try:
        with vramd.connect(daemon["sock"]) as client:
            client.reload()
            with pytest.raises(vramd.DaemonError, match=r"^GET /v1/models/broken/plan: model 'broken' is "
                                                        r"invalid: .*nowhere.safetensors") as refused:
                client.plan("broken")
            assert refused.value.status == 409
    finally:
        (daemon["daemon"].models / "broken.toml").unlink()
        request(daemon["sock"], "POST", "/v1/reload")


@pytest.mark.parametrize("name", TRANSFORMERS_CONVERTED)
def test_converter_transformers_in_a_config_serves_transformers_own_names(daemon, name):
    """converter = "transformers": the daemon has its Python write transformers' rules for
    config.json's model type over the checkpoint's names. Its plan, its leases and vramctl
    convert have the module's own names; managed under a limit below its size (no derive), the
    module equals transformers' own from_pretrained of the folder (float32)."""
    import transformers
    model = f"{name}-transformers"
    limit, size = daemon["references"][f"{name}-converted"]
    reference = getattr(transformers, type(hub_layout_cases()[name]()).__name__).from_pretrained(
        daemon["folder"] / name, dtype=torch.float32).eval()
    module = empty(hub_layout_cases()[name])
    shown = json.loads(vramctl(daemon["sock"], "convert", daemon["daemon"].models / f"{model}.toml", "--json",
                               "--daemon-config", daemon["daemon"].config).stdout)
    inputs = torch.tensor([[4, 5, 9, 33, 2, 60, 7, 11]])
    with vramd.connect(daemon["sock"]) as client:
        planned = client.plan(model)["names"]
        assert set(planned) == set(shown["tensors"]) and set(planned) <= set(module.state_dict()), planned
        with vramd.manage(module, model, client=client, limit=limit) as managed, torch.no_grad():
            assert managed.lease.manifest["model"] == model  # nothing derived: the names are the module's
            got = module(inputs)[0]
            assert managed.stats()["peak"] <= limit < size
    with torch.no_grad():
        expected = reference(inputs)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    leases_end(daemon, model)


def test_converter_transformers_takes_an_update_in_the_checkpoints_layout(daemon, tmp_path):
    """An update of a converter = "transformers" model, saved as transformers saves it, is
    converted as the checkpoint was: the lease then holds the new model's fused experts."""
    import transformers
    torch.manual_seed(9)
    changed = hub_layout_cases()["mixtral"]().eval()
    changed.save_pretrained(tmp_path, safe_serialization=True)
    fused = transformers.MixtralForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    with vramd.connect(daemon["sock"]) as client:
        client.load("mixtral-transformers")
        client.update("mixtral-transformers", str(tmp_path / "model.safetensors"))
        with client.lease("mixtral-transformers") as state_dict:
            for key in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                        "model.layers.0.self_attn.q_proj.weight"):
                assert torch.equal(state_dict[key], fused[key]), key
    leases_end(daemon, "mixtral-transformers")


def test_converter_transformers_refusals_name_the_key_and_the_remedy(daemon, tmp_path):
    """vramctl check of converter = "transformers" configs (the daemon's checks are the same):
    a Python without vramd's package, one that is not there, a checkpoint without config.json,
    a GGUF file where no gguf.lua is found to read it first; and a model type transformers has no rules for keeps every name."""
    import venv
    venv.create(tmp_path / "bare", with_pip=False)  # a real Python, without vramd's package
    folder = daemon["folder"]
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "model.safetensors").symlink_to(folder / "mixtral" / "model.safetensors")
    cases = {
        "bare": (folder / "mixtral", tmp_path / "bare" / "bin" / "python",
                 r"converter = \"transformers\": .*bare/bin/python -m vramd\.transformers_converter failed \(status 1\): "
                 r".*No module named 'vramd'.*\(python in the daemon's config names a Python with vramd's package and "
                 r"transformers 5: docs/config\.md\)"),
        "missing": (folder / "mixtral", tmp_path / "nowhere" / "python",
                    r"converter = \"transformers\": cannot run .*nowhere/python: No such file or directory"),
        "no-config": (tmp_path / "no-config", sys.executable,
                      r"converter = \"transformers\": transformers' rules are chosen by config\.json's model_type: no "
                      r"config\.json in .*no-config"),
        # A GGUF file's names are made Hugging Face's by gguf.lua first, which this daemon's
        # config (no converters folder) does not have.
        "gguf": (folder / "toy.gguf", sys.executable,
                 r"converter = 'transformers': transformers' rules read Hugging Face's names, which the shipped "
                 r"converter gguf\.lua makes of a GGUF file's, and none of the daemon's converter folders holds it "
                 r"\(looked for .*gguf\.lua\)"),
    }
    for case, (checkpoint, python, message) in cases.items():
        (tmp_path / f"{case}.vramd.toml").write_text(f'python = "{python}"\n')
        (tmp_path / f"{case}.toml").write_text(f'checkpoint = "{checkpoint}"\narchitecture = "weights"\n'
                                               'converter = "transformers"\n')
        checked = vramctl(daemon["sock"], "check", tmp_path / f"{case}.toml", "--daemon-config",
                          tmp_path / f"{case}.vramd.toml", check=False)
        assert checked.returncode != 0 and re.search(rf"{case}\.toml:3:\d+: {message}", checked.stdout), checked.stdout
    # OPT: transformers converts nothing as it loads it, so every name stays the checkpoint's.
    (tmp_path / "opt.toml").write_text(f'checkpoint = "{folder / "opt"}"\narchitecture = "weights"\n'
                                       'converter = "transformers"\n')
    shown = json.loads(vramctl(daemon["sock"], "convert", tmp_path / "opt.toml", "--json", "--daemon-config",
                               daemon["daemon"].config).stdout)
    assert shown["tensors"] and all(v["expression"] == f"src[{t!r}]" for t, v in shown["tensors"].items()), shown


def test_a_dcp_folder_of_such_a_model_is_converted_the_same_way(daemon, tmp_path):
    """The Mixtral's tensors in the Hub's layout saved by torch.distributed.checkpoint, config.json
    beside them: managed with the daemon deriving the conversion, and served with converter =
    "transformers", the module equals from_pretrained of the safetensors folder (float32)."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp
    import transformers
    from safetensors.torch import load_file
    folder = daemon["folder"] / "mixtral"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(load_file(folder / "model.safetensors"), checkpoint_id=tmp_path / "dcp")
    shutil.copy(folder / "config.json", tmp_path / "dcp" / "config.json")
    limit, size = daemon["references"]["mixtral-converted"]
    for name, converter in (("mixtral-dcp", ""), ("mixtral-dcp-transformers", 'converter = "transformers"\n')):
        (daemon["daemon"].models / f"{name}.toml").write_text(converter + served(tmp_path / "dcp", "float32", limit))
    reference = transformers.MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = torch.tensor([[8, 5, 9, 33, 2, 60, 7]])
    with torch.no_grad():
        expected = reference(inputs)[0]
    try:
        with vramd.connect(daemon["sock"]) as client:
            client.reload()
            for name in ("mixtral-dcp", "mixtral-dcp-transformers"):
                module = empty(hub_layout_cases()["mixtral"])
                with vramd.manage(module, name, client=client, limit=limit) as managed, torch.no_grad():
                    leased = managed.lease.manifest["model"]
                    assert leased.startswith("mixtral-dcp.derived-") if name == "mixtral-dcp" else leased == name
                    got = module(inputs)[0]
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
                leases_end(daemon, leased)
    finally:
        for name in ("mixtral-dcp", "mixtral-dcp-transformers"):
            (daemon["daemon"].models / f"{name}.toml").unlink()
        request(daemon["sock"], "POST", "/v1/reload")


def test_a_gguf_file_of_such_a_model_is_converted_after_gguf_lua_or_refused_naming_its_names(daemon, tmp_path):
    """A Mixtral written as llama.cpp writes one (stacked experts, Meta's rotary rows). Served
    with its own names, transformers' conversion has nothing to read: the ManageError says whose
    names they are. Served with gguf.lua (Hugging Face's names, one tensor per expert), the
    daemon derives the conversion over gguf.lua's results; served with converter =
    "transformers", the daemon chains gguf.lua and transformers' rules itself (its metadata's
    model type, no derive). Either way the managed module equals the transformers model the file
    was written from (float32)."""
    sys.path.insert(0, str(ROOT / "tests" / "storage"))
    from test_gguf import llama_gguf
    torch.manual_seed(2)
    model = hub_layout_cases()["mixtral"]().eval()
    llama_gguf(tmp_path / "mixtral.gguf", model)
    limit, size = daemon["references"]["mixtral-converted"]
    configs = {"mixtral-gguf": "", "mixtral-gguf-lua": f'converter = "{ROOT / "scripts/converters/gguf.lua"}"\n',
               "mixtral-gguf-transformers": 'converter = "transformers"\n'}
    for name, converter in configs.items():
        (daemon["daemon"].models / f"{name}.toml").write_text(
            f'checkpoint = "{tmp_path / "mixtral.gguf"}"\narchitecture = "weights"\ndtype = "float32"\n{converter}'
            f'[vram]\nonload = {{ device = "cpu", dtype = "float32" }}\nlimit = {limit}\n')
    inputs = torch.tensor([[6, 5, 9, 33, 2, 60, 7]])
    with torch.no_grad():
        expected = model(inputs)[0]
    try:
        with vramd.connect(daemon["sock"]) as client:
            client.reload()
            module = empty(hub_layout_cases()["mixtral"])
            with pytest.raises(vramd.ManageError, match=r"does not fit MixtralForCausalLM: .* without a leased tensor: "
                                                        r".*; the leased names are a GGUF file's own \(llama\.cpp's, "
                                                        r"such as 'blk\.0\.attn_q\.weight'\), .*serve the model's "
                                                        r"safetensors"):
                vramd.manage(module, "mixtral-gguf", client=client)
            assert all(p.is_meta for p in module.parameters())
            with vramd.manage(module, "mixtral-gguf-lua", client=client, limit=limit) as managed, torch.no_grad():
                derived = managed.lease.manifest["model"]
                assert derived.startswith("mixtral-gguf-lua.derived-"), derived
                got = module(inputs)[0]
                assert managed.stats()["peak"] <= limit < size
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            planned = client.plan("mixtral-gguf-transformers")["names"]
            assert "model.layers.1.mlp.experts.gate_up_proj" in planned and set(planned) <= set(model.state_dict())
            module = empty(hub_layout_cases()["mixtral"])
            with vramd.manage(module, "mixtral-gguf-transformers", client=client, limit=limit) as managed, torch.no_grad():
                assert managed.lease.manifest["model"] == "mixtral-gguf-transformers"  # nothing derived
                got = module(inputs)[0]
                assert managed.stats()["peak"] <= limit < size
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            leases_end(daemon, "mixtral-gguf", derived, "mixtral-gguf-transformers")
    finally:
        for name in configs:
            (daemon["daemon"].models / f"{name}.toml").unlink()
        request(daemon["sock"], "POST", "/v1/reload")


def test_clients_sending_the_same_rules_share_one_derived_model(daemon):
    """Two clients deriving with the same converter get one model; the daemon holds it once."""
    from vramd.transformers_converter import checkpoint_keys, lua_converter
    text = lua_converter(empty(hub_layout_cases()["mixtral"]), checkpoint_keys(daemon["folder"] / "mixtral"))
    with vramd.connect(daemon["sock"]) as a, vramd.connect(daemon["sock"]) as b:
        first, second = a.derive("mixtral", text), b.derive("mixtral", text)
        assert first["name"] == second["name"] and first["derived_from"] == "mixtral" and not second["created"]
        assert [m["name"] for m in a.list() if m.get("derived_from") == "mixtral"] == [first["name"]]
        loads = a.status(first["name"])["stats"]["loads"]
        with a.lease(first["name"]) as one, b.lease(first["name"]) as two:
            fused = "model.layers.0.mlp.experts.gate_up_proj"
            assert one[fused].shape == (3, 16, 16) and torch.equal(one[fused], two[fused])  # w1 and w3, stacked, joined
        assert a.status(first["name"])["stats"]["loads"] - loads <= 1  # one copy of the converted weights, for both
    leases_end(daemon, first["name"])


def test_a_derived_model_refuses_what_it_cannot_be_and_goes_with_its_base(daemon):
    """Bad converters and bad bases are refused naming what is wrong, and nothing else is harmed;
    a derived model goes when its base's config does, and its converter's file with it."""
    d, sock = daemon["daemon"], daemon["sock"]
    (d.models / "granitemoe-copy.toml").write_text((d.models / "granitemoe.toml").read_text())
    from vramd.transformers_converter import checkpoint_keys, lua_converter
    text = lua_converter(empty(hub_layout_cases()["granitemoe"]), checkpoint_keys(daemon["folder"] / "granitemoe"))
    converters = lambda: sorted(Path(sock).parent.glob(f"{Path(sock).name}.derived-*/*.lua"))  # noqa: E731
    with vramd.connect(sock) as client:
        client.reload()
        before = converters()
        refusals = [("granitemoe-copy", "return {x = src['no.such.tensor']}", 400, r"derive 'granitemoe-copy': .*no\.such\.tensor"),
                    ("granitemoe-copy", "return {", 400, r"derive 'granitemoe-copy': .*granitemoe-copy\.toml: converter: the converter sent:1: unexpected symbol near '<eof>'"),
                    ("granitemoe-copy", "", 400, "the converter is empty"),
                    ("no-such-model", text, 404, "no model named 'no-such-model'"),
                    # Over a base with a converter, the sent one reads that converter's names.
                    ("granitemoe-converted", text, 400, r"the base's converter \(.*granitemoe\.lua\) gives no tensor "
                                                        r"named 'model\.layers\.0\.block_sparse_moe\.input_linear\.weight'"),
                    ("granitemoe-transformers", text, 409, r"names transformers' conversion \(converter = "
                                                           r"\"transformers\"\) already")]
        for base, converter, status, message in refusals:
            with pytest.raises(vramd.DaemonError) as refused:
                client.derive(base, converter)
            assert refused.value.status == status and re.search(message, str(refused.value)), refused.value
        for body in (b"[]", b'{"converter": 3}', b'{"converter": "", "also": 1}', b"not json"):
            status, answer = request(sock, "POST", "/v1/models/granitemoe-copy/derive", body)
            assert status == 400 and b'derive: expected {\\"converter\\"' in answer, answer
        assert converters() == before  # a refused converter leaves no file behind
        made = client.derive("granitemoe-copy", text)
        assert made["created"] and made["state"] == "unloaded" and len(converters()) == len(before) + 1
        listed = vramctl(sock, "list")
        assert re.search(rf"\n{re.escape(made['name'])} +unloaded .*\n    derived from granitemoe-copy with a converter "
                         "a client sent\n", listed.stdout), listed.stdout
        with pytest.raises(vramd.DaemonError, match="it is derived from 'granitemoe-copy' already") as refused:
            client.derive(made["name"], text)
        assert refused.value.status == 400
        with client.lease(made["name"]) as leased:
            assert "model.layers.1.block_sparse_moe.experts.gate_up_proj" in leased  # renamed
            assert "model.layers.1.block_sparse_moe.input_linear.weight" not in leased
        client.unload(made["name"])  # once the lease has ended: then nothing holds it back
        # A second one, of another text, left loaded.
        loaded = client.derive("granitemoe-copy", text + "-- the same, in a text of its own\n")
        assert loaded["created"] and loaded["name"] != made["name"]
        client.load(loaded["name"])
        # Its base's config goes: so do the derived models, the unloaded one at once with its
        # converter's file, the loaded one once it is unloaded (refusing new work from now on).
        (d.models / "granitemoe-copy.toml").unlink()
        names = [m["name"] for m in client.reload()]
        assert made["name"] not in names and "granitemoe-copy" not in names and "granitemoe" in names
        assert len(set(converters()) - set(before)) <= 1  # the loaded one's, until its unload ends
        gone = re.escape(loaded["name"])  # being removed, or removed already: its unload may have ended
        with pytest.raises(vramd.DaemonError, match=rf"model '{gone}' was removed|no model named '{gone}'") as refused:
            client.lease(loaded["name"])
        assert refused.value.status == 404
        with pytest.raises(vramd.DaemonError) as refused:
            client.status(made["name"])
        assert refused.value.status == 404


def test_a_derived_model_is_removed_by_delete_once_its_leases_end(daemon):
    """DELETE /v1/models/NAME (Client.remove) removes a model derived with a client's converter:
    at once when idle, after its lease when leased, its converter's file with it; the base and a
    model of a config file stay (the latter is a 409 naming its file)."""
    sock = daemon["sock"]
    from vramd.transformers_converter import checkpoint_keys, lua_converter
    text = lua_converter(empty(hub_layout_cases()["mixtral"]), checkpoint_keys(daemon["folder"] / "mixtral"))
    converters = lambda: set(Path(sock).parent.glob(f"{Path(sock).name}.derived-*/*.lua"))  # noqa: E731
    with vramd.connect(sock) as client, vramd.connect(sock) as other:
        before = converters()
        idle = client.derive("mixtral", text + "-- removed while idle\n")
        assert client.remove(idle["name"]) == {"name": idle["name"], "state": "removed"}
        assert converters() == before and idle["name"] not in [m["name"] for m in client.list()]
        leased = client.derive("mixtral", text + "-- removed once its lease ends\n")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with client.lease(leased["name"]) as weights:
                removal = pool.submit(other.remove, leased["name"])
                # The removal waits behind the lease (its unload queued), refusing new work meanwhile.
                wait_for(lambda: get_json(sock, f"/v1/models/{leased['name']}")["queued"] >= 1, what="the removal's unload")
                with pytest.raises(vramd.DaemonError, match="was removed") as refused:
                    client.load(leased["name"])
                assert refused.value.status == 404 and "model.layers.0.mlp.experts.gate_up_proj" in weights
            assert removal.result(timeout=120) == {"name": leased["name"], "state": "removed"}
        assert converters() == before
        status, body = request(sock, "GET", f"/v1/models/{leased['name']}")
        assert status == 404, body
        status, body = request(sock, "PUT", "/v1/models/mixtral")
        assert status == 405 and b"use GET (or DELETE, to remove a derived model)" in body, body
        for name, code, message in [("mixtral", 409, r"is the config file .*mixtral\.toml's: remove that file"),
                                    ("no-such-model", 404, "no model named 'no-such-model'")]:
            with pytest.raises(vramd.DaemonError, match=message) as refused:
                client.remove(name)
            assert refused.value.status == code
        assert client.status("mixtral")["state"] in ("ready", "unloaded")


def test_names_a_written_converter_quotes_reach_the_sandbox_as_they_are(tmp_path):
    """The string literals vramd.transformers_converter writes: a quote, a backslash, a control
    byte or UTF-8 followed by a digit must not run into its escape (a\\34 then 1 is a\\341)."""
    from vramd.transformers_converter import _lua
    keys = ['a"1', "b\\2", "\u00e93", "tab\t4", "plain.5"]
    save_file({k: torch.full((2,), float(i)) for i, k in enumerate(keys)}, tmp_path / "names.safetensors")
    (tmp_path / "names.lua").write_text("local out = {}\n" + "".join(
        f"out[{_lua(f't{i}')}] = src[{_lua(k)}]\n" for i, k in enumerate(keys)) + "return out\n")
    (tmp_path / "names.toml").write_text(f'architecture = "weights"\ncheckpoint = "{tmp_path / "names.safetensors"}"\n'
                                         f'converter = "{tmp_path / "names.lua"}"\n')
    shown = json.loads(vramctl(tmp_path / "none.sock", "convert", tmp_path / "names.toml", "--json").stdout)
    assert {t: v["expression"] for t, v in shown["tensors"].items()} == {
        f"t{i}": "src[" + repr(k).replace("\\t", "\\x09") + "]" for i, k in enumerate(keys)}, shown


def test_a_rule_the_converter_cannot_express_is_named(daemon):
    """transformers' Interleave (a rule registered for a model type, here a Mixtral's config
    under a type of its own) has no converter expression: writing the converter fails naming it."""
    from transformers.conversion_mapping import (Interleave, MergeModulelist, WeightConverter,
                                                 register_checkpoint_conversion_mapping)
    from vramd.transformers_converter import ConversionError, checkpoint_keys, lua_converter
    module = empty(hub_layout_cases()["mixtral"])
    module.config.model_type = "vramd_test_interleaved"
    register_checkpoint_conversion_mapping("vramd_test_interleaved", [WeightConverter(
        [".experts.*.w1.weight"], [".experts.gate_up_proj"], operations=[MergeModulelist(dim=0), Interleave(dim=1)])],
        overwrite=True)
    keys = checkpoint_keys(daemon["folder"] / "mixtral")
    with pytest.raises(ConversionError, match=r"mixtral: transformers' rule \['\.experts\.\*\.w1\.weight'\] -> "
                                              r"\['\.experts\.gate_up_proj'\] for 'model\.layers\.0\.block_sparse_moe"
                                              r"\.experts\.gate_up_proj' takes Interleave\(.*\), which vramd's "
                                              r"converters do not express"):
        lua_converter(module, keys, str(daemon["folder"] / "mixtral"))


@pytest.mark.parametrize("name, rules", [
    ("mixtral", r"\(\.block_sparse_moe\. renamed \.mlp\.; \.experts\.\*\.w1\.weight, \.experts\.\*\.w3\.weight merged "
                r"into \.experts\.gate_up_proj; \.experts\.\*\.w2\.weight merged into \.experts\.down_proj\)"),
    ("granitemoe", r"\(block_sparse_moe\.input_linear\.weight renamed block_sparse_moe\.experts\.gate_up_proj; "),
])
def test_a_checkpoint_transformers_converts_as_it_loads_is_named_as_such(daemon, name, rules):
    """A model saved by transformers 5 in the Hub's layout lacks the names its module has until
    transformers' load-time conversion (transformers.conversion_mapping) makes them: with
    convert=False the ManageError says so, naming the rules, and the module is left as it was."""
    module = empty(hub_layout_cases()[name])
    with vramd.connect(daemon["sock"]) as client:
        with pytest.raises(vramd.ManageError, match=r"6 without a leased tensor: .*; all of them are what transformers' "
                                                    rf"own conversion for model_type '{name}' makes of the leased names "
                                                    rf"as it loads {rules}.*, which vramd.manage applies \(in a model the "
                                                    r"daemon derives\) unless given convert=False; or name it in the "
                                                    r"model's config, converter = \"transformers\", .*python -m "
                                                    r"vramd.transformers_converter") as refused:
            vramd.manage(module, name, client=client, convert=False)
    assert "init_empty_weights" not in str(refused.value)
    assert all(p.is_meta for p in module.parameters())
    # Built on the meta device, its rotary buffers lack a tensor too: named apart, with their remedy.
    with torch.device("meta"):
        module = hub_layout_cases()[name]()
    with vramd.connect(daemon["sock"]) as client, pytest.raises(vramd.ManageError) as refused:
        vramd.manage(module, name, client=client, convert=False)
    assert (f"8 without a leased tensor" in str(refused.value) and "6 of them (" in str(refused.value) and
            "; the other 2 (buffers made on the meta device" in str(refused.value)), refused.value
    # Converted by the daemon, only the buffers are left to name.
    with vramd.connect(daemon["sock"]) as client, pytest.raises(vramd.ManageError) as refused:
        vramd.manage(module, name, client=client)
    assert ("2 without a leased tensor" in str(refused.value) and "buffers made on the meta device" in str(refused.value)
            and "transformers' own conversion" not in str(refused.value)), refused.value
    assert all(p.is_meta for p in module.parameters())
    leases_end(daemon, name)


def test_a_reservation_past_the_budget_is_refused_and_a_killed_clients_is_freed(daemon, tmp_path):
    sock = daemon["sock"]
    with vramd.connect(sock) as client:
        with pytest.raises(vramd.DaemonError) as refused:
            client.lease("toy-bfloat16", reserve=("cpu", 3 << 30))
        assert refused.value.status == 507
        assert "needs 3.00 GiB on cpu, more than the daemon's whole budget for it (2.00 GiB)" in str(refused.value)
        # Sizes that would print alike though they differ are said to the byte (#66: 1025 MiB
        # against a budget of 1024 MiB read "needs 1.00 GiB ..., its whole budget (1.00 GiB)").
        with pytest.raises(vramd.DaemonError) as refused:
            client.lease("toy-bfloat16", reserve=("cpu", (2 << 30) + (1 << 20)))
        assert refused.value.status == 507 and re.search(r"needs 2\.00 GiB \(\d+ bytes\) on cpu, more than the daemon's "
                                                         r"whole budget for it \(2\.00 GiB \(2147483648 bytes\)\)",
                                                         str(refused.value)), str(refused.value)
        # A client that dies holding room: the room is back once its connection is.
        code = textwrap.dedent(f"""\
            import sys, time
            sys.path.insert(0, {str(ROOT / "python")!r})
            import vramd
            lease = vramd.connect({str(sock)!r}).lease("toy-bfloat16", reserve=("cpu", 1 << 30))
            print("holding", flush=True)
            time.sleep(120)
            """)
        holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "holding"
        status = get_json(sock, "/v1/status")
        assert status["devices"]["cpu"]["models"]["toy-bfloat16"] >= 1 << 30
        leases = get_json(sock, "/v1/models/toy-bfloat16")["leases"]
        assert [(lease["pid"], lease["reserved"]) for lease in leases] == [(holder.pid, {"cpu": 1 << 30})]
        metrics = request(sock, "GET", "/metrics")[1].decode()
        assert f'vramd_lease_reserved_bytes{{model="toy-bfloat16",pid="{holder.pid}",device="cpu"}} 1073741824' in metrics
        # Beside it, another 1.5 GiB cannot fit: refused naming the holder and the budget.
        with pytest.raises(vramd.DaemonError) as refused:
            client.lease("toy-float8_e4m3fn", reserve=("cpu", 3 << 29))
        assert refused.value.status == 507 and "toy-bfloat16" in str(refused.value), str(refused.value)
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        holder.wait()
        wait_for(lambda: get_json(sock, "/v1/status")["devices"]["cpu"]["models"]["toy-bfloat16"] < 1 << 30,
                 what="the dead client's room to be freed")
        assert time.monotonic() - killed < 5  # at once: its death closed the connection (a wide margin when busy)
        with client.lease("toy-float8_e4m3fn", reserve=("cpu", 3 << 29)):
            pass
        # A client that says anything but {"peak": N} on its lease ends that lease, and nothing else.
        lease = client.lease("toy-float8_e4m3fn", reserve=("cpu", 1 << 20))
        lease._sock.sendall(b'{"peak": "lots"}\n')
        leases_end(daemon, "toy-float8_e4m3fn")
        assert "its client sent a line that is neither" in daemon["daemon"].log.read_text()
        lease.close()
        # Other models served on throughout.
        with torch.device("meta"):
            model = Toy()
        with vramd.manage(model, "toy-bfloat16", client=client):
            with torch.no_grad():
                ids = torch.tensor([[1, 2, 3]])
                assert torch.equal(model(ids), daemon["references"]["toy-bfloat16"](ids))


@pytest.mark.parametrize("name", ["unet", "vae", "opt"])
def test_the_example_manages_a_diffusers_and_a_transformers_model_as_it_says(daemon, name):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "manage_module.py"), name,
                             str(daemon["folder"] / name)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "VRAMD_SOCKET": str(daemon["sock"]),
                                 "PYTHONPATH": str(ROOT / "python")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "managed on cpu" in result.stdout and "equals the whole model" in result.stdout, result.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: managed modules on a GPU not run")
@pytest.mark.parametrize("rest", [*REST, "gguf"])
def test_a_module_managed_on_cuda_equals_the_whole_module_there_within_its_limit(daemon, rest):
    import copy
    device = torch.device("cuda:0")
    d = 256 if rest == "gguf" else 32  # GGUF's K types are blocks of 256
    with torch.device("meta"):
        model = Toy(d=d).eval()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad(), vramd.connect(daemon["sock"]) as client:
        Toy(d=d).to(device)(ids)  # the ops' first run (cuBLAS's workspace: 32 MiB on an H200) before counting
        with vramd.manage(model, f"toy-{rest}", client=client, device=device) as managed:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            got = [model(ids) for _ in range(3)]
            torch.cuda.synchronize()
            grown = torch.cuda.max_memory_allocated(device) - before
            stats = managed.stats()
            leases = get_json(daemon["sock"], f"/v1/models/toy-{rest}")["leases"]
            assert [lease["reserved"] for lease in leases] == [{"cuda:0": stats["limit"]}]
            # Where it computes, a move is nothing; to the CPU, refused before anything changes.
            model.to("cuda")
            assert {p.device for p in model.parameters()} == {device}
            with pytest.raises(vramd.ManageError, match=r"is managed by vramd on cuda:0 in float32: it cannot be "
                                                        r"moved or cast to cpu in float32"):
                model.to("cpu")
            assert torch.equal(model(ids), got[0])
            # On a stream of the caller's, whose kernels read prefetched copies the side stream
            # then copies into again once they are dropped: it waits for that stream too.
            hits = managed.stats()["prefetch_hits"]
            user = torch.cuda.Stream(device)
            user.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(user):
                on_user = [model(ids) for _ in range(3)]
            user.synchronize()
            assert managed.stats()["prefetch_hits"] > hits
        reference = copy.deepcopy(daemon["references"][f"toy-{rest}"]).to(device)
        for out in got + on_user:
            assert torch.equal(out, reference(ids))
    assert 0 < stats["peak"] <= stats["limit"] and stats["prefetch_hits"] > 0, stats
    assert stats["pinned_bytes"] > 0, stats  # the lease page-locked, else copies wait for the host (a warning)
    # The device's growth: the copies (within the limit) and the activations, nothing more.
    assert grown <= stats["limit"] + largest_unit(Toy(d=d)) + (4 << 20), (grown, stats)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: a refused page-locking not run")
def test_a_refused_page_locking_warns_and_leaves_the_next_kernel_its_own_error(daemon, monkeypatch):
    """CUDA keeps a refused call's error as the thread's last one, which torch's next kernel launch
    check would raise as that kernel's: a lease CUDA refuses to page-lock is warned of, its copies
    wait for the host, and the forward runs."""
    import copy
    device = torch.device("cuda:0")
    cudart = torch.cuda.cudart()
    real = cudart.cudaHostRegister
    monkeypatch.setattr(cudart, "cudaHostRegister", lambda address, size, flags: real(0, 0, flags))  # refused by CUDA
    with torch.device("meta"):
        model = Toy().eval()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad(), vramd.connect(daemon["sock"]) as client:
        with pytest.warns(UserWarning, match=r"page-locking [0-9.]+ [KMG]?i?B of the lease of 'toy-bfloat16' failed \(.+\): "
                                             r"their copies to cuda:0 wait for the host"):
            managed = vramd.manage(model, "toy-bfloat16", client=client, device=device)
        with managed:
            got = model(ids)  # the first kernels after the refusal
            assert managed.stats()["pinned_bytes"] == 0
        assert torch.equal(got, copy.deepcopy(daemon["references"]["toy-bfloat16"]).to(device)(ids))


def big_toy():
    return Toy(d=512, vocabulary=64, blocks=8)


@pytest.fixture(scope="module")
def big(daemon):
    """A module of about 68 MB in float32, resting in bfloat16, served under a quarter of it."""
    folder, d = daemon["folder"], daemon["daemon"]
    torch.manual_seed(5)
    model = big_toy()
    save_file({k: v for k, v in model.state_dict().items() if k != "head.weight"}, folder / "big.safetensors")
    (d.models / "big.toml").write_text(served(folder / "big.safetensors", "bfloat16", weights_bytes(model) // 4))
    request(daemon["sock"], "POST", "/v1/reload")
    return {"bytes": weights_bytes(model), "largest": largest_unit(model)}


CLIENT = """\
import sys, time, torch
sys.path.insert(0, {python!r})
sys.path.insert(0, {tests!r})
import vramd
from test_manage import big_toy

def anonymous():  # what the process allocated itself (the leased pages are the daemon's memfd's)
    return sum(int(line.split()[1]) * 1024 for line in open("/proc/self/smaps_rollup") if line.startswith("Anonymous:"))

with torch.device("meta"):
    model = big_toy().eval()
ids = torch.randint(0, 64, (1, 16))
from test_manage import Toy
with torch.no_grad(), vramd.connect({sock!r}) as client:
    Toy(d=512, vocabulary=64, blocks=1)(ids)  # the ops' first run at these sizes (kernels, buffers) before counting
    before = anonymous()
    with vramd.manage(model, "big", client=client, dtype={dtype}) as managed:
        for _ in range(3):
            model(ids)
        print(anonymous() - before, managed.stats()["peak"], managed.limit, flush=True)
        sys.stdin.readline()  # hold the lease until told
"""


def start_client(daemon, dtype, env=None):
    code = CLIENT.format(python=str(ROOT / "python"), tests=str(Path(__file__).parent), sock=str(daemon["sock"]),
                         dtype=dtype)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def test_a_managed_process_grows_by_its_limit_not_by_the_model(daemon, big):
    # Anonymous memory (what the process allocates itself; the leased pages are the daemon's memfd's):
    # its computation copies in float32 stay within the limit, plus a unit brought in ahead and a
    # few MiB of activations and the allocator's own.
    # glibc's malloc keeps freed blocks past its adaptive threshold for reuse: one fixed threshold
    # makes what the process holds what it uses.
    client = start_client(daemon, "torch.float32", {"MALLOC_MMAP_THRESHOLD_": "131072"})
    grown, peak, limit = map(int, client.stdout.readline().split())
    print(f"anonymous memory grew {grown} bytes; peak copies {peak} of a {limit}-byte limit; model {big['bytes']}")
    client.communicate("\n", timeout=60)
    assert 0 < peak <= limit < big["bytes"]
    assert grown <= limit + big["largest"] + (8 << 20), (grown, limit, big)


def test_three_processes_managing_one_model_share_its_one_copy(daemon, big):
    # Computing in the resting dtype on the CPU, each computes from the leased pages themselves: three
    # clients add at most 1.1x the resting bytes of PSS in all (the daemon's region, shared).
    clients = [start_client(daemon, "torch.bfloat16") for _ in range(3)]
    for client in clients:
        grown, peak, limit = map(int, client.stdout.readline().split())
        assert peak == 0, peak  # no copies: the weights are used where they rest
    resting = get_json(daemon["sock"], "/v1/models/big")["devices"]["cpu"]
    from test_lease import mapped_pss
    pss = sum(mapped_pss(client.pid, "memfd:vramd:big") for client in clients)
    for client in clients:
        client.communicate("\n", timeout=60)
    assert 0 < pss <= 1.1 * resting, (pss, resting)
