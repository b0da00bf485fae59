"""Partitioned loading across N processes (ZeRO-3 style, c10d Gloo over loopback) against one
process, on the ~1B-parameter LLaMA-shaped bfloat16 checkpoint bench/load.py makes.

    .venv/bin/python bench/partition.py [--workdir /tmp/vramd-bench] [--ranks 2 4] [--forwards 3]

For each N: every rank's peak RSS against the goal (1/N of the model + the two largest layers
gathered whole + the process's own footprint before loading, measured in the same run), the
largest number of weight bytes a rank held (vramd's own count), and the forward time against
one process given the same number of threads as each rank (the cost of the gathers) and
against one process with every core. Every rank computes the whole forward, so on a machine
with fewer cores than ranks the second ratio shows the cores shared, not the gathers.

The peer: PyTorch FSDP2 (`fully_shard`, bench/fsdp_peer.py) on the same checkpoint, ranks,
threads, input and forwards, started with torchrun. Its logits are compared with vramd's.

Loads are cold: the checkpoint's pages are dropped from the page cache before each contender.
vramd's load (its own load_seconds: every rank's slices read) is timed with the model's
direct_io left to choose, and again with direct_io = true (a run of its own, one forward);
FSDP2's from its process group's start to every rank's shards in place.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VRAMCTL = ROOT / "build" / "bin" / "vramctl"
sys.path.insert(0, str(ROOT / "bench"))
import load as load_bench  # noqa: E402  (makes the checkpoint)
from vram import evict  # noqa: E402

GiB = 1 << 30


def vramctl_run(config, daemon_config, inputs, stats, forwards, *flags):
    subprocess.run([VRAMCTL, "run", config, "--daemon-config", daemon_config, "--input", inputs,
                    "--stats-json", stats, "--repeat", str(forwards), *flags], check=True)
    return json.loads(stats.read_text())


def fsdp_run(folder, inputs, workdir, ranks, threads, forwards):
    out = workdir / f"fsdp{ranks}.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    ROOT / "bench" / "fsdp_peer.py", "--checkpoint", folder, "--input", inputs, "--forwards",
                    str(forwards), "--threads", str(threads), "--out", out,
                    "--logits", workdir / f"fsdp{ranks}-logits.safetensors"],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads(out.read_text())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--forwards", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    import torch
    from safetensors.torch import load_file, save_file

    workdir = Path(args.workdir)
    folder = workdir / "llama1b"
    load_bench.make_checkpoint(folder)
    inputs = workdir / "in.safetensors"
    save_file({"input_ids": torch.randint(0, 32000, (1, args.tokens), generator=torch.Generator().manual_seed(0))}, inputs)
    daemon_config = workdir / "vramd.toml"
    daemon_config.write_text('[budgets]\ncpu = "16GiB"\n')
    cores = os.cpu_count()

    single = workdir / "single.toml"
    single.write_text(f'name = "single"\ncheckpoint = "{folder}"\n')
    print(f"model {folder}, {cores} cores, {args.forwards} forwards of {args.tokens} tokens")
    alone = vramctl_run(single, daemon_config, inputs, workdir / "single.json", args.forwards, "--copy")
    model = alone["bytes"]
    print(f"one process, {cores} threads: forward {alone['forward_median_seconds']:.2f} s, "
          f"peak RSS {alone['peak_rss'] / GiB:.2f} GiB (model {model / GiB:.2f} GiB)")
    for ranks in args.ranks:
        threads = max(1, cores // ranks)
        same = vramctl_run(single, daemon_config, inputs, workdir / "single.json", args.forwards, "--copy",
                           "--threads", str(threads))
        config = workdir / f"partitioned{ranks}.toml"
        config.write_text(f'name = "p{ranks}"\ncheckpoint = "{folder}"\n[partition]\nworld_size = {ranks}\n'
                          'timeout = "10m"\n')
        ours = workdir / f"p{ranks}-out.safetensors"
        evict(folder / "model.safetensors")
        got = vramctl_run(config, daemon_config, inputs, workdir / f"p{ranks}.json", args.forwards, "--ranks", str(ranks),
                          "--output", ours)
        largest = got["vram"]["streaming_room"]
        goal = model / ranks + 2 * largest + got["peak_rss_before_load"]
        worst = max(rank["peak_rss"] for rank in got["ranks"])
        print(f"{ranks} ranks, {threads} thread(s) each: forward {got['forward_median_seconds']:.2f} s = "
              f"{got['forward_median_seconds'] / same['forward_median_seconds']:.2f}x one process with {threads} "
              f"thread(s) ({same['forward_median_seconds']:.2f} s), "
              f"{got['forward_median_seconds'] / alone['forward_median_seconds']:.2f}x one with {cores}")
        peaks = ", ".join(f"{r['peak_rss'] / GiB:.2f}" for r in got["ranks"])
        print(f"  per-rank peak RSS {peaks} GiB; goal "
              f"{goal / GiB:.2f} GiB (model/{ranks} {model / ranks / GiB:.2f} + 2 x largest layer "
              f"{largest / GiB:.3f} + process before load {got['peak_rss_before_load'] / GiB:.2f}): "
              f"{'met' if worst <= goal else 'MISSED'}")
        print(f"  weights held at most {max(r['peak_weights'] for r in got['ranks']) / GiB:.2f} GiB per rank "
              f"(slices {got['ranks'][0]['slices'] / GiB:.2f} GiB); one process holds {model / GiB:.2f} GiB")
        direct = workdir / f"partitioned{ranks}-direct.toml"
        direct.write_text(config.read_text() + "[vram]\ndirect_io = true\n")
        evict(folder / "model.safetensors")
        got_direct = vramctl_run(direct, daemon_config, inputs, workdir / f"p{ranks}-direct.json", 1, "--ranks", str(ranks))
        evict(folder / "model.safetensors")
        fsdp = fsdp_run(folder, inputs, workdir, ranks, threads, args.forwards)
        fsdp_load = max(r["load_seconds"] for r in fsdp["ranks"])
        print(f"  cold load: vramd {got['load_seconds']:.2f} s (direct_io auto), with direct_io = true {got_direct['load_seconds']:.2f} s; FSDP2 {fsdp_load:.2f} s (vramd "
              f"{fsdp_load / got['load_seconds']:.2f}x and {fsdp_load / got_direct['load_seconds']:.2f}x faster)")
        theirs = load_file(workdir / f"fsdp{ranks}-logits.safetensors")["logits"].float()
        mine = load_file(ours)["logits"].float()
        fsdp_peaks = ", ".join(f"{r['peak_rss'] / GiB:.2f}" for r in fsdp["ranks"])
        print(f"  FSDP2 fully_shard, {ranks} ranks: forward {fsdp['forward_median_seconds']:.2f} s (vramd "
              f"{fsdp['forward_median_seconds'] / got['forward_median_seconds']:.2f}x faster); per-rank peak RSS "
              f"{fsdp_peaks} GiB (vramd's {worst / max(r['peak_rss'] for r in fsdp['ranks']):.2f}x of it), after loading "
              f"{max(r['peak_rss_loading'] for r in fsdp['ranks']) / GiB:.2f} GiB, process before load "
              f"{fsdp['ranks'][0]['rss_before_load'] / GiB:.2f} GiB")
        print(f"  logits: max |vramd - FSDP2| {(mine - theirs).abs().max().item():.4f}, "
              f"largest |logit| {theirs.abs().max().item():.4f} (bfloat16)")


if __name__ == "__main__":
    main()
