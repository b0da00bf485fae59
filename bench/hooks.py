"""What each offloading hook costs the host per unit: a chain of UNITS small Linear layers (WIDTH
wide: their kernels take microseconds, so a forward is mostly the hooks' time), weights at rest in
bfloat16 in host memory, computed on DEVICE (bfloat16 on a GPU, float32 on the CPU), the same
chain several ways in this one process:

    resident     no offload: the chain whole on DEVICE in the computation dtype (the bound)
    vramd        vramd.manage under a limit of a quarter of the chain (the units that fit stay)
    vramd-lean   vramd.manage under a limit of two layers (every layer comes in at each call)
    vramd-all    vramd.manage under a limit of the whole chain: after the first call every layer
                 stays, so what it adds to resident is the hooks' bookkeeping alone, no copy
    vramd-sync   vramd as above without prefetching: on a GPU each hook copies its layer on the
                 computing stream (against vramd: what the side stream's event and stream switch cost)
    accelerate   accelerate.cpu_offload (diffusers' sequential offload): every layer's weights
                 moved to DEVICE at each call
    diffusers    diffusers' group offload, leaf_level (on a GPU with use_stream: the next layer's
                 copy made on a side stream while one computes)
    diffsynth    DiffSynth-Studio's enable_vram_management: every Linear wrapped, offload and onload
                 in host memory in bfloat16, computed on DEVICE, under a vram_limit of a quarter

For each: the median forward, and what each layer adds to the resident bound, (forward -
resident's) / UNITS, in microseconds. A model of many small layers on a GPU is bound by this:
bench/manage.py's diffusion transformer makes 89 unit loads a forward. Every contender's output
is compared with the resident chain's.

    .venv/bin/python bench/hooks.py [--device cuda:0] [--units 256] [--width 64] [--forwards 30] [--json FILE]
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
import vram  # noqa: E402  bench/vram.py
import vramd  # noqa: E402

VRAMD = ROOT / "build" / "bin" / "vramd"
CONTENDERS = ("resident", "vramd", "vramd-lean", "vramd-all", "vramd-sync", "accelerate", "diffusers", "diffsynth")


def chain(args):
    return nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.units)]).eval()


def prepared(kind, args, rest, client):
    """The chain made ready by `kind`, and what to close afterwards (or None)."""
    device, dtype = torch.device(args.device), args.dtype
    if kind.startswith("vramd"):
        with torch.device("meta"):
            model = chain(args)
        limit = {"vramd-lean": 2 * args.unit_bytes, "vramd-all": args.units * args.unit_bytes}.get(kind, args.limit)
        return model, vramd.manage(model, "chain", client=client, device=device, dtype=dtype, limit=limit,
                                   prefetch=False if kind == "vramd-sync" else None)
    model = chain(args)
    model.load_state_dict(rest)
    if kind == "resident":
        return model.to(device, dtype), None
    if kind == "diffsynth":  # at rest in bfloat16, cast to the computation dtype as it computes, as vramd's
        model, _ = vram.diffsynth_managed(model.to(torch.bfloat16), {nn.Linear: "AutoWrappedLinear"}, device, dtype,
                                          args.limit)
        return model, None
    model.to(dtype)  # in host memory, in the computation dtype: these hooks do not cast
    if kind == "accelerate":
        from accelerate import cpu_offload
        cpu_offload(model, execution_device=device)
    else:
        from diffusers.hooks import apply_group_offloading
        apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="leaf_level", use_stream=device.type == "cuda")
    return model, None


def timed(model, x, args):
    gpu = args.device.startswith("cuda")
    times = []
    with torch.inference_mode():
        for i in range(args.forwards + 3):  # three untimed: the copies' first allocations, the prefetch order
            if gpu:
                torch.cuda.synchronize(args.device)
            start = time.perf_counter()
            output = model(x)
            if gpu:
                torch.cuda.synchronize(args.device)
            if i >= 3:
                times.append(time.perf_counter() - start)
    return statistics.median(times), output.float().cpu()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--units", type=int, default=256)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--forwards", type=int, default=30)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    args.unit_bytes = (args.width + 1) * args.width * args.dtype.itemsize
    args.limit = args.units * args.unit_bytes // 4
    torch.manual_seed(0)
    rest = {name: value.to(torch.bfloat16) for name, value in chain(args).state_dict().items()}
    x = torch.randn(4, args.width, device=args.device, dtype=args.dtype)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        (work / "models").mkdir()
        save_file(rest, work / "chain.safetensors")
        (work / "models" / "chain.toml").write_text(
            f'checkpoint = "{work / "chain.safetensors"}"\narchitecture = "weights"\n'
            f'[vram]\nonload = {{ device = "cpu", dtype = "bfloat16" }}\nlimit = {args.limit}\n')
        budget = f'"{args.device}" = "1GiB"' if args.device != "cpu" else ""
        with vram.serving(work, f'cpu = "4GiB"\n{budget}', VRAMD) as client:
            client.load("chain")
            for kind in args.contenders.split(","):
                model, managed = prepared(kind, args, rest, client)
                try:
                    seconds, output = timed(model, x, args)
                    results[kind] = {"forward_seconds": seconds, "output": output}
                    if managed is not None:
                        results[kind]["managed"] = managed.stats()
                finally:
                    if managed is not None:
                        managed.close()

    print(f"{args.units} Linear({args.width}, {args.width}) layers at rest in bfloat16, computed in "
          f"{str(args.dtype).removeprefix('torch.')} on {args.device}; median of {args.forwards} forwards")
    resident = results.get("resident")
    calls = args.forwards + 3
    for kind, r in results.items():
        line = f"  {kind:11s} forward {r['forward_seconds'] * 1e3:8.3f} ms"
        if resident:
            over = (r["forward_seconds"] - resident["forward_seconds"]) / args.units
            line += f", {over * 1e6:6.1f} us a layer over resident"
            worst = (r["output"] - resident["output"]).abs().max()
            line += ", output equal to resident's" if torch.equal(r["output"], resident["output"]) else \
                f", output differs from resident's by {worst:.3g}"
        if "managed" in r:
            m = r["managed"]
            line += f" ({m['loads'] / calls:.0f} loads, {m['hook_seconds'] / calls * 1e3:.2f} ms in its hooks a forward)"
        print(line)
    for peer in (kind for kind in ("diffusers", "diffsynth", "accelerate") if kind in results and "vramd" in results):
        ratio = results[peer]["forward_seconds"] / results["vramd"]["forward_seconds"]
        print(f"vramd against {peer}: forward {ratio:.2f}x as fast")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": args.device, "units": args.units, "width": args.width, "limit": args.limit,
            "results": {k: {key: v for key, v in r.items() if key != "output"} for k, r in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
