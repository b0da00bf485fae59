"""Storage benchmark: vramd's DiskMap against the Python safetensors package, same files, same run.

    .venv/bin/python bench/storage.py [--workdir /tmp/vramd-bench] [--repeat 5]

Prints each figure and its ratio. Timings are taken inside each process (Python's perf_counter,
vramd's steady_clock), best of --repeat, page cache warm unless the row says cold. Cold rows
evict the file from the page cache with posix_fadvise(DONTNEED) first, and are compared with
the disk's bound on the same file: fio's O_DIRECT io_uring reads where fio is installed, else
`dd iflag=direct`. See docs/benchmarks.md.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "build" / "bin" / "vramd_bench_storage"


def make_many(path, count):
    if path.exists():
        return
    tensors = {}
    for i in range(count):
        shape = [(64,), (16, 64), (32, 32), (8, 8, 4)][i % 4]
        tensors[f"model.layers.{i // 16}.block.{i % 16}.weight"] = torch.full(shape, float(i % 7), dtype=torch.bfloat16)
    save_file(tensors, path)


def make_model(path, layers, hidden, intermediate):
    if path.exists():
        return
    generator = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(32000, hidden, generator=generator).to(torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = torch.randn(hidden, hidden, generator=generator).to(torch.bfloat16)
        for name, shape in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                            ("down_proj", (hidden, intermediate))):
            tensors[p + f"mlp.{name}.weight"] = torch.randn(*shape, generator=generator).to(torch.bfloat16)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(tensors, path)


def best(function, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def ours(*args):
    out = subprocess.run([str(BENCH), *map(str, args)], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def ours_fresh(repeat, *args):
    """Best of `repeat` fresh processes, each timing its first load: no allocator warmed for us."""
    return min(ours(args[0], args[1], 1, *args[2:])["seconds"][0] for _ in range(repeat))


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path):
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def dd_direct_seconds(path, jobs=1):
    """`jobs` dd processes at once, each reading its share of the file with O_DIRECT (bs=16M):
    the disk's bound with as many requests in flight, where fio is not installed."""
    blocks = -(-path.stat().st_size // (16 << 20))
    share = -(-blocks // jobs)
    start = time.perf_counter()
    readers = [subprocess.Popen(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct", f"skip={i * share}",
                                 f"count={share}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for i in range(jobs)]
    if any(r.wait() for r in readers):
        raise RuntimeError("dd failed")
    return time.perf_counter() - start


def fio_direct_seconds(path, jobs=1, depth=16, block="8M", hugetlbfs=None):
    """fio reading the file with O_DIRECT through io_uring, `jobs` jobs each on its share with
    `depth` requests of `block` in flight (vramd's O_DIRECT reads keep 16 of 8 MiB), its buffers
    of huge pages from `hugetlbfs` where given: the disk's bound. The seconds its throughput
    gives for the whole file, fio's start left out."""
    size = path.stat().st_size
    share = -(-size // jobs // (1 << 20)) << 20
    memory = [f"--iomem=mmaphuge:{hugetlbfs}/vramd-bench-fio"] if hugetlbfs else []
    out = subprocess.run(["fio", "--name=bound", f"--filename={path}", "--readonly", "--rw=read", "--direct=1",
                          "--ioengine=io_uring", f"--bs={block}", f"--iodepth={depth}", f"--numjobs={jobs}",
                          f"--size={share}", f"--offset_increment={share}", "--group_reporting", *memory,
                          "--output-format=json"], check=True, capture_output=True, text=True).stdout
    read = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return size / read["bw_bytes"]


def hugetlbfs_with(pages):
    """A hugetlbfs mount with at least `pages` free huge pages of 2 MiB, or None."""
    meminfo = Path("/proc/meminfo").read_text()
    free = int(re.search(r"HugePages_Free:\s+(\d+)", meminfo).group(1))
    if free < pages or "Hugepagesize:       2048 kB" not in meminfo:
        return None
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    return next((fields[1] for fields in mounts if fields[2] == "hugetlbfs"), None)


def disk_bounds(model):
    """The disk's bound rows of a cold round: fio (io_uring, O_DIRECT) at vramd's depth with one
    job and with four, its buffers of 4 KiB pages and, where hugetlbfs has room, of huge pages
    (a request of 4 KiB pages is split at the device's segment limit: 254 of them, 1 MiB, on a
    virtio disk; vramd's buffers are huge pages); else dd with one and 16."""
    if not shutil.which("fio"):
        print("fio is not installed (apt-get install fio): dd's O_DIRECT reads stand for the disk's bound", flush=True)
        return {"dd O_DIRECT, 1 job": lambda: dd_direct_seconds(model),
                "dd O_DIRECT, 16 jobs": lambda: dd_direct_seconds(model, 16)}
    bounds = {"fio O_DIRECT io_uring, 1 job x 16": lambda: fio_direct_seconds(model),
              "fio O_DIRECT io_uring, 4 jobs x 16": lambda: fio_direct_seconds(model, 4)}
    huge = hugetlbfs_with(4 * 16 * 4 + 8)  # 4 jobs' 16 buffers of 8 MiB
    if huge:
        bounds["fio ..., 1 job x 16, huge pages"] = lambda: fio_direct_seconds(model, hugetlbfs=huge)
        bounds["fio ..., 4 jobs x 16, huge pages"] = lambda: fio_direct_seconds(model, 4, hugetlbfs=huge)
    else:
        print("no hugetlbfs with 264 free huge pages: fio's buffers are of 4 KiB pages alone "
              "(echo 264 > /proc/sys/vm/nr_hugepages; mount -t hugetlbfs none /dev/hugepages)", flush=True)
    return bounds


PEERS = ["runai", "fastsafetensors", "safetensors"]


def peer_seconds(which, path):
    """A Python loader's read of `path` in a fresh process (bench/peer_read.py)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "peer_read.py"), which, str(path)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])["seconds"]


def interleaved(model, rounds):
    """vramd and the fastest loaders people pick instead, round by round (each read in a fresh
    process, the file evicted first for the cold rows, read once just before for the warm ones),
    with the disk's bound (disk_bounds) in each cold round. Returns, by row, the seconds of each
    round, and the names of the bound's rows."""
    contenders = {
        "vramd load_tensors, page cache": lambda: ours("read", model, 1, "bulk")["seconds"][0],
        "vramd load_tensors, O_DIRECT": lambda: ours("read", model, 1, "bulk-direct")["seconds"][0],
        # The same reads into memory faulted in before (as a daemon's is, reused), and the reads
        # alone into 16 buffers of 8 MiB reused (as fio's are).
        "vramd O_DIRECT, memory faulted in": lambda: ours("read", model, 1, "staged-direct")["seconds"][0],
        "vramd O_DIRECT, the reads alone": lambda: ours("read", model, 1, "staged-huge")["seconds"][0],
        **{peer: (lambda peer=peer: peer_seconds(peer, model)) for peer in PEERS},
    }
    bounds = disk_bounds(model)
    # What the destination's fresh memory costs, no read: each contender but vramd's two staged
    # rows faults in as much (on a VM that hands freed memory back to its host, slowly).
    faults = {"fresh memory faulted in, huge pages": lambda: ours("read", model, 1, "fault-huge")["seconds"][0],
              "fresh memory faulted in, 4 KiB pages": lambda: ours("read", model, 1, "fault-pages")["seconds"][0]}
    cold_rows, warm_rows = {}, {}
    for _ in range(rounds):
        for name, run in {**bounds, **faults, **contenders}.items():
            evict(model)
            cold_rows.setdefault(name, []).append(run())
        for name, run in contenders.items():
            if "O_DIRECT" in name:
                continue  # reads around the page cache: as cold
            warm(model)
            warm_rows.setdefault(name, []).append(run())
    return cold_rows, warm_rows, list(bounds)


def print_interleaved(cold, warm, bounds, size):
    gib = size / 2**30
    for title, table in (("cold (page cache evicted before each read)", cold), ("warm (file in the page cache)", warm)):
        rounds = len(next(iter(table.values())))
        print(f"\n{title}: GiB/s in each of {rounds} rounds; ratios of each round's figure", flush=True)
        for name, seconds in table.items():
            peers = [min(table[p][i] for p in PEERS) for i in range(rounds)]
            bound = [min(cold[b][i] for b in bounds) for i in range(rounds)]
            line = f"  {name:40s} " + " ".join(f"{gib / s:5.2f}" for s in seconds)
            if name.startswith("vramd"):
                line += "   against the fastest peer " + " ".join(f"{p / s:.2f}x" for s, p in zip(seconds, peers))
                if table is cold:
                    line += ", against the disk's bound " + " ".join(f"{b / s:.2f}x" for s, b in zip(seconds, bound))
            print(line, flush=True)


def touch_pages(tensors):
    total = 0
    for t in tensors.values():
        flat = t.reshape(-1).view(torch.uint8)
        total += int(flat[::4096].sum()) if flat.numel() else 0
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3, help="of the interleaved rows against the fastest loaders")
    parser.add_argument("--only-peers", action="store_true", help="the interleaved rows alone")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    many, model = work / f"many-{args.tensors}.safetensors", work / "model-1g.safetensors"
    print(f"generating checkpoints in {work} (once) ...", file=sys.stderr)
    make_many(many, args.tensors)
    make_model(model, layers=10, hidden=2048, intermediate=5632)
    size = model.stat().st_size
    rows = []
    print(f"{size / 2**20:.0f} MiB of bfloat16 tensors read into host memory, against runai-model-streamer, "
          f"fastsafetensors and safetensors (issue #70)", flush=True)
    print_interleaved(*interleaved(model, args.rounds), size)
    if args.only_peers:
        return

    def row(name, theirs, vramd, note=""):
        rows.append((name, theirs, vramd, theirs / vramd, note))
        print(f"{name:58s} safetensors {theirs * 1e3:9.1f} ms   vramd {vramd * 1e3:9.1f} ms   "
              f"ratio {theirs / vramd:5.2f}x  {note}", flush=True)

    # Open + index.
    def open_keys():
        with safe_open(many, framework="pt") as f:
            return len(f.keys())

    def open_shapes():
        with safe_open(many, framework="pt") as f:
            return [(f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()]

    warm(many)
    ours_index = min(ours("index", many, args.repeat)["seconds"])
    row(f"open + index, {args.tensors} tensors (their keys only)", best(open_keys, args.repeat), ours_index)
    row(f"open + index, {args.tensors} tensors (with dtypes, shapes)", best(open_shapes, args.repeat), ours_index)

    # Warm reads of a 1 GiB bf16 model.
    warm(model)
    copies = best(lambda: [t.clone() for t in load_file(model).values()], args.repeat)
    row("read all, bf16, into owned memory (load_file + clone)", copies, ours_fresh(args.repeat, "read", model, "bulk"), "warm")
    row("  the same, one tensor at a time (load_tensor, pread)", copies, ours_fresh(args.repeat, "read", model, "copy"), "warm")
    mapped = best(lambda: touch_pages(load_file(model)), args.repeat)
    row("read all, bf16, mapped and faulted in (load_file + touch)", mapped,
        ours_fresh(args.repeat, "read", model, "view"), "warm")
    converted = best(lambda: [t.float() for t in load_file(model).values()], args.repeat)
    row("read all, bf16 -> float32 (load_file + .float())", converted,
        ours_fresh(args.repeat, "read", model, "bulk", "f32"), "warm")

    # Cold reads, against the device's own O_DIRECT throughput.
    def cold(function):
        times = []
        for _ in range(3):
            evict(model)
            times.append(function())
        return min(times)

    def theirs_cold():
        start = time.perf_counter()
        [t.clone() for t in load_file(model).values()]
        return time.perf_counter() - start

    dd = cold(lambda: dd_direct_seconds(model))
    gib = size / 2**30
    print(f"\ncold read of {size / 2**20:.0f} MiB (page cache evicted before each run; best of 3)", flush=True)
    print(f"  dd bs=16M iflag=direct                 {gib / dd:5.2f} GiB/s", flush=True)
    for label, seconds in (
        ("vramd load_tensors, O_DIRECT", cold(lambda: ours("read", model, 1, "bulk-direct")["seconds"][0])),
        ("vramd load_tensors, page cache", cold(lambda: ours("read", model, 1, "bulk")["seconds"][0])),
        ("vramd staged reads (a GPU's), O_DIRECT", cold(lambda: ours("read", model, 1, "staged-direct")["seconds"][0])),
        ("  the reads alone, into 4 KiB pages", cold(lambda: ours("read", model, 1, "staged-pages")["seconds"][0])),
        ("  the reads alone, into huge pages", cold(lambda: ours("read", model, 1, "staged-huge")["seconds"][0])),
        ("safetensors load_file + clone", cold(theirs_cold)),
    ):
        print(f"  {label:38s} {gib / seconds:5.2f} GiB/s = {dd / seconds:.2f}x dd", flush=True)


if __name__ == "__main__":
    main()
