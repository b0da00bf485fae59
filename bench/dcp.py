"""Merging a sharded training checkpoint (torch.distributed.checkpoint, as FSDP2 saves it) into
one file: `vramctl convert --output merged.safetensors` against torch's own dcp_to_torch_save,
on the same folder, each from a cold page cache.

    .venv/bin/python bench/dcp.py [--workdir /tmp/vramd-bench-dcp] [--layers 12] [--ranks 2]

The folder: LAYERS float32 Linear(4096, 4096) layers (64 MiB each) wrapped with fully_shard on
RANKS Gloo processes and saved with dcp.save. Prints each contender's time and peak RSS (the
kernel's, from wait4), the ratios, and vramd's peak RSS against the goal: the largest tensor
plus the footprint of vramctl before it reads a weight (vramctl convert without --output, which
plans the same merge and reads nothing, measured in the same run). The two merged files are compared tensor for tensor.

Then the folder loads partitioned on twice as many ranks as saved it (`vramctl run --ranks`,
load only): each rank's bytes read of the chunk files (`bytes_read` of --stats-json, counted by
the reader) against its 1/N of the model.
"""
import json
import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VRAMCTL = ROOT / "build" / "bin" / "vramctl"
sys.path.insert(0, str(ROOT / "bench"))
from vram import evict  # noqa: E402

MiB = 1 << 20
WIDTH = 4096


def save(rank, ranks, port, layers, out):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (ranks,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    dcp.save({"model": model.state_dict()}, checkpoint_id=out)
    dist.destroy_process_group()


def make_folder(workdir, layers, ranks):
    folder = workdir / f"dcp-{layers}x{ranks}"
    if (folder / ".metadata").exists():
        return folder
    import torch.multiprocessing as mp
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(save, args=(ranks, port, layers, str(folder)), nprocs=ranks)
    return folder


def measured(command):
    """Seconds and peak RSS (bytes) of the command, run to completion."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{command[0]} failed: {process.stderr.read().decode()}")
    return seconds, usage.ru_maxrss * 1024


def cold(folder):
    for path in folder.iterdir():
        evict(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/vramd-bench-dcp"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    folder = make_folder(args.workdir, args.layers, args.ranks)
    model_bytes = args.layers * WIDTH * WIDTH * 4
    largest = WIDTH * WIDTH * 4
    (args.workdir / "vramd.toml").write_text('[budgets]\ncpu = "64GiB"\n')
    config = args.workdir / "merge.toml"
    config.write_text(f'name = "merge"\ncheckpoint = "{folder}"\n')
    ours, theirs = args.workdir / "ours.safetensors", args.workdir / "theirs.pt"

    _, footprint = measured([VRAMCTL, "convert", config, "--daemon-config", args.workdir / "vramd.toml"])
    cold(folder)
    our_seconds, our_rss = measured([VRAMCTL, "convert", config, "--daemon-config", args.workdir / "vramd.toml",
                                     "--output", ours])
    cold(folder)
    their_seconds, their_rss = measured([sys.executable, "-c", "import sys; from torch.distributed.checkpoint."
                                         "format_utils import dcp_to_torch_save; dcp_to_torch_save(*sys.argv[1:])",
                                         folder, theirs])

    import torch
    from safetensors.torch import load_file
    got, want = load_file(ours), torch.load(theirs, weights_only=True, mmap=True)["model"]
    assert sorted(got) == sorted(f"model.{name}" for name in want), (sorted(got)[:3], sorted(want)[:3])
    assert all(torch.equal(got[f"model.{name}"], value) for name, value in want.items())

    print(f"checkpoint: {folder}: {args.layers} x {WIDTH}x{WIDTH} float32 = {model_bytes / MiB:.0f} MiB, saved by "
          f"FSDP2 on {args.ranks} ranks; the largest tensor {largest / MiB:.0f} MiB")
    print(f"vramctl convert --output: {our_seconds:6.2f} s, peak RSS {our_rss / MiB:7.1f} MiB")
    print(f"dcp_to_torch_save:        {their_seconds:6.2f} s, peak RSS {their_rss / MiB:7.1f} MiB")
    print(f"time: {their_seconds / our_seconds:.2f}x faster; peak RSS: {our_rss / their_rss:.2f} of theirs")
    print(f"vramd's peak RSS against the goal (largest tensor {largest / MiB:.0f} MiB + vramctl's own "
          f"{footprint / MiB:.0f} MiB before reading): {our_rss / (largest + footprint):.2f}")
    print("the merged files are equal tensor for tensor")

    ranks = 2 * args.ranks
    config = args.workdir / "reshard.toml"
    config.write_text(f'name = "reshard"\ncheckpoint = "{folder}"\narchitecture = "weights"\n'
                      f'[partition]\nworld_size = {ranks}\ntimeout = "120s"\n')
    stats = args.workdir / "reshard.json"
    subprocess.run([VRAMCTL, "run", config, "--daemon-config", args.workdir / "vramd.toml", "--ranks", str(ranks),
                    "--stats-json", stats], check=True, capture_output=True)
    read = [rank["bytes_read"] for rank in json.loads(stats.read_text())["ranks"]]
    print(f"saved on {args.ranks} ranks, loaded on {ranks}: bytes read by each rank, in MiB: "
          f"{', '.join(f'{n / MiB:.1f}' for n in read)}; the most against 1/{ranks} of the model: "
          f"{max(read) / (model_bytes / ranks):.3f}")


if __name__ == "__main__":
    main()
