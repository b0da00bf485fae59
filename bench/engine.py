"""The block engine against an earlier build of vramd: forward time of the bench/load.py model
(the 1.1B bfloat16 LLaMA) through this build's `vramctl run` and a baseline's, alternating,
each in a fresh process, with the page cache warm. Logits must be equal bit for bit.

    .venv/bin/python bench/engine.py --baseline /path/to/old/build/bin/vramctl [--rounds 3] [--repeat 5]

Issue #20 measured the families-as-files engine against the C++ llama.cpp it replaced (commit
bb0b234): git worktree add /tmp/base bb0b234, build its vramctl, pass it as --baseline.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import SHAPE, VRAMCTL, warm_checkpoint  # noqa: E402


def forward_seconds(vramctl, config, inputs, output, repeat):
    """The median of `repeat` forwards in one fresh process."""
    stats = output.with_suffix(".json")
    subprocess.run([str(vramctl), "run", config, "-i", inputs, "-o", output, "--repeat", str(repeat),
                    "--stats-json", stats], check=True, capture_output=True, timeout=1800)
    return json.loads(stats.read_text())["forward_median_seconds"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="an earlier build's vramctl")
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per build, alternating")
    parser.add_argument("--repeat", type=int, default=5, help="forwards per process")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    folder = workdir / "llama-1b"
    warm_checkpoint(folder)
    config = workdir / "engine.toml"
    config.write_text(f'checkpoint = "{folder}"\n')
    inputs = workdir / "engine-inputs.safetensors"
    save_file({"input_ids": (torch.arange(args.tokens).view(1, -1) % SHAPE["vocab_size"]).contiguous()}, inputs)

    builds = {"engine": VRAMCTL, "baseline": Path(args.baseline)}
    times = {name: [] for name in builds}
    for _ in range(args.rounds):
        for name, vramctl in builds.items():
            times[name].append(forward_seconds(vramctl, config, inputs, workdir / f"engine-{name}.safetensors", args.repeat))
    logits = {name: load_file(workdir / f"engine-{name}.safetensors")["logits"] for name in builds}
    equal = torch.equal(logits["engine"], logits["baseline"])
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:9s} median forward {medians[name]:.3f} s (per process: {', '.join(f'{v:.3f}' for v in values)})")
    print(f"ratio engine / baseline: {medians['engine'] / medians['baseline']:.3f}; logits equal bit for bit: {equal}")
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
