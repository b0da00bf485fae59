"""Streaming a checkpoint larger than memory at the storage's speed (issue #26): a LLaMA-13B-shaped
bfloat16 checkpoint (about 24.2 GiB, random weights, Hugging Face sharded safetensors: 41 shards
of about 635 MB) computed on the CPU under a 2 GiB weight limit, its layers read from disk at every
forward. The checkpoint's pages are dropped from the page cache (posix_fadvise DONTNEED on every
shard) before each contender, and every contender runs in a fresh process on the same files and
the same input ids.

    .venv/bin/python bench/stream.py [--workdir /tmp/vramd-stream] [--vramctl build/bin/vramctl]
                                     [--tokens 16] [--forwards 1] [--limit 2GiB] [--only NAME]
                                     [--memory-cap SIZE]
    # a machine with more memory than the checkpoint (a GPU machine: 128 GiB, 16 cores):
    # every contender in a memory cgroup of 8 GiB, page cache included
    .venv/bin/python bench/stream.py --memory-cap 8GiB --layers 20 --bound-seconds 5
    # developing: a small checkpoint (a few hundred MB) and a proportionally smaller limit
    .venv/bin/python bench/stream.py --layers 8 --hidden 1024 --intermediate 2816 \\
                                     --shard-size 50MB --limit 100MiB --bound-seconds 5

What it measures, in one run:

  read bound          the best of three readers, each 16 O_DIRECT reads of 8 MiB in flight over the
                      shards' blocks in order, looping, for --bound-seconds (10 s): a Python reader
                      (16 threads of os.preadv) into buffers of huge pages, the same into 4 KiB
                      pages, and fio (io_uring, iodepth 16, bs 8M, file_service_type=sequential;
                      when installed). A virtual disk can fill 4 KiB pages several times slower
                      than huge ones, and fio's buffers have 4 KiB pages: the bound is what the
                      disk gives the best of them.
  compute             the model's own forward with every layer resident (no [vram], --copy: weights
                      read at load, none during the forward; median of 3) where the checkpoint
                      fits in memory with room to spare (MemAvailable, outside any --memory-cap).
  compute estimate    elsewhere, as on the development VM (24 GiB in 23.5), vramd runs it
                      resident on two checkpoints of the same shape with a = 4 and b = 12 decoder
                      layers (at most the model's; one checkpoint, the model itself, where it has
                      4 or fewer); per layer = (tb - ta) / (b - a), fixed (embedding, final norm,
                      head) = ta - a x per layer, compute(N) = fixed + N x per layer. Layers 8
                      apart: a forward's noise (±0.3 s on the development VM) is spread over 8
                      layers, not 2 as with the 2 and 4 layers measured before 2026-11-25 (which
                      put the issue's case at 15.4 s where 4 and 12 layers put it at 21-24 s).
  vramd direct_io=true / false / "auto"
                      vramctl run on the checkpoint folder, [vram] offload = onload = "disk",
                      computation = cpu bfloat16, limit = --limit; the daemon's default zero-copy
                      loading (no --copy). "auto" is new in issue #26: a vramctl that does not know
                      it fails with a config error, which is reported, and the run goes on.
  accelerate          transformers' AutoModelForCausalLM.from_pretrained(folder, device_map="auto",
                      max_memory={"cpu": limit}, offload_folder=WORKDIR/accelerate-offload,
                      dtype=torch.bfloat16): the layers that do not fit in the limit on "disk".
                      With a safetensors checkpoint, transformers (5.x, accelerate_disk_offload)
                      points the offload index at the shards themselves, so nothing is rewritten
                      (the run prints what was written to the offload folder and to disk to show
                      it), and accelerate's hooks read each offloaded weight from the shard (a
                      memory mapping) when its layer runs. But loading still copies the offloaded
                      tensors into memory once and drops them (transformers' spawn_materialize),
                      so its load reads nearly the whole checkpoint ("read during load"): in a
                      small run, every decoder layer's bytes.
  vramd direct_io=auto, accelerate's resident bytes
                      the same as "auto" with accelerate's bytes on the CPU as the limit: its
                      device map keeps room free for the offloaded modules, so it holds less than
                      max_memory; this row compares peak RSS at equal resident weights.

Per contender: wall (process start to exit: load, the forwards, writing the logits), load (vramd:
plan + load; accelerate: the from_pretrained call), forward (--forwards 1: the one forward; more:
vramd's is vramctl's median of all of them, sorted[n // 2], which is the median of those after
the first when the first is the slowest and n is odd; accelerate's is the median of those after
the first), waited on reads (vramd's wait_seconds, per forward), peak RSS (VmHWM, read by the
contender's own process: getrusage's ru_maxrss would count the parent's memory through vfork),
bytes read from and written to the disk by the whole process (ru_inblock and ru_oublock of
wait4 on that child, in 512-byte blocks: reads below the page cache, O_DIRECT included), the
machine's CPU time stolen by the host while it ran (/proc/stat's steal: on a VM whose virtual
disk's work runs on the cores behind its vCPUs, the op threads compute more slowly while the
disk is read, and the goal on the forward measures the host too: the goals say so from 2%), and the
effective read speed: bytes streamed per forward over the forward time. For vramd those are its
bytes_streamed (layers brought in, whether the page cache held them or not; with --forwards > 1,
the average); for accelerate, what /proc/self/io counts as read from the disk during the forwards,
which the page cache it filled while loading can make smaller than what its forward uses.

Logits: vramctl writes each vramd run's outputs, the accelerate contender saves its logits; all
are saved in the workdir (logits-NAME.safetensors) and compared with the first vramd run's:
bit-exact equality is expected across vramd runs; against accelerate the max abs difference is
printed (equal bit for bit when the issue was filed).

Goals (issue #26), for each vramd run: streamed bytes read at >= 90% of the read bound; forward
within 1.1x of max(the bound's time for the bytes streamed, compute); "auto" no slower than the
better of true and false; >= 2x accelerate's wall time; peak RSS <= accelerate's. A markdown table
ready for docs/benchmarks.md and the machine (CPU, cores, memory, the disk under the workdir)
close the output.

--memory-cap SIZE runs every contender (not the compute, which must hold the whole model) in a
memory cgroup of SIZE, page cache included (bench/vram.py's MemoryCap: cgroup v1, or v2 where the
memory controller is given to new groups; it fails, naming the cgroup's error, before anything
runs where neither is): on a machine with more memory than the checkpoint, the contenders then
have less, as in the issue's case, and `direct_io = "auto"` sees the cgroup's limit.

The checkpoint is made once, layer by layer (one shard in memory at a time), in a folder of the
workdir whose name encodes its shape, so a small test checkpoint is never taken for the big one.
Every tensor, norms included, is randn * 0.02 in bfloat16, from a generator seeded with its place
in the model (torch's CPU randn uses one core: a shard's tensors are made on all of them at once).
Making the full one writes 24.2 GiB and takes several minutes; where it does not fit in memory,
the benchmark then needs some 11 GB more for the 4- and 12-layer ones (and, for the 12-layer
forward, some 9 GiB of memory).
"""
import argparse
import concurrent.futures
import ctypes
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import vram as vram_bench  # noqa: E402  (evict, status_bytes, streamed_vram)

GIB = 2**30
BLOCK = 8 << 20  # the read bound's block size
HUGE_PAGE = 2 << 20
DIRECT_IO = {"vramd direct_io=true": "true", "vramd direct_io=false": "false", "vramd direct_io=auto": '"auto"'}
# The same as auto, with the bytes accelerate kept on the CPU under its max_memory as the limit
# (its device map keeps room free for offloaded modules, so it holds less than the limit): peak
# RSS at equal resident weights. Runs after accelerate.
AT_ACCELERATES = "vramd direct_io=auto, accelerate's resident bytes"
DIRECT_IO[AT_ACCELERATES] = '"auto"'


def parse_size(text):
    """A size as vramd reads one (docs/config.md): KiB, MiB, GiB, TiB and K, M, G, T are powers of
    1024; KB, MB, GB, TB of 1000; a bare number counts bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(?:([KMGT])(i?B)?|B)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2GiB, 600MB)")
    number, prefix, suffix = match.groups()
    power = "KMGT".index(prefix) + 1 if prefix else 0
    return int(float(number) * (1000 if suffix == "B" else 1024) ** power)


def gb(nbytes):
    return f"{nbytes / 1e9:.2f} GB"


# --- the checkpoint -----------------------------------------------------------------------------

def llama_config(shape):
    import transformers
    return transformers.LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                                    intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                                    num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
                                    max_position_embeddings=4096, rms_norm_eps=1e-5, dtype="bfloat16")


def checkpoint_folder(workdir, shape):
    return Path(workdir) / ("llama-bf16-h{hidden}-i{intermediate}-l{layers}-a{heads}-v{vocab}".format(**shape))


def shard_files(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return [folder / name for name in sorted(set(index["weight_map"].values()))]


def make_checkpoint(folder, shape, shard_bytes):
    """Writes a random LLaMA checkpoint of this shape as Hugging Face sharded safetensors, one shard
    in memory at a time, unless the folder already holds one (the index is written last)."""
    if (folder / "model.safetensors.index.json").exists() and (folder / "config.json").exists():
        return
    import torch
    import transformers
    from safetensors.torch import save_file
    config = llama_config(shape)
    with torch.device("meta"):
        names = [(name, tuple(p.shape)) for name, p in transformers.LlamaForCausalLM(config).state_dict().items()]
    shards, size = [[]], 0
    for name, tensor_shape in names:  # in model order: a shard holds consecutive tensors
        nbytes = 2 * torch.Size(tensor_shape).numel()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor_shape))
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    seeds = {name: seed for seed, (name, _) in enumerate(names)}

    def tensor_of(item):  # torch's CPU randn runs on one core: one generator, seeded, a tensor
        name, tensor_shape = item
        generator = torch.Generator().manual_seed(seeds[name])
        return name, (torch.randn(tensor_shape, generator=generator) * 0.02).to(torch.bfloat16)
    weight_map, total = {}, 0
    start = time.perf_counter()
    pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(pool.map(tensor_of, shard))
        save_file(tensors, folder / (file + ".partial"), metadata={"format": "pt"})
        os.replace(folder / (file + ".partial"), folder / file)
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
        print(f"  {file}: {gb(total)} written, {time.perf_counter() - start:.0f} s", flush=True)
    pool.shutdown()
    config.save_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def evict(files):
    for file in files:
        vram_bench.evict(file)


# --- the read bound -----------------------------------------------------------------------------

def fio_bound(fio, files, seconds):
    """Bytes per second of fio's sequential O_DIRECT reads over the shards: io_uring, 16 reads of
    8 MiB in flight, into its default buffers (malloc: 4 KiB pages)."""
    command = [fio, "--name=bound", "--ioengine=io_uring", "--iodepth=16", "--bs=8M", "--direct=1", "--rw=read",
               "--filename=" + ":".join(str(f).replace(":", "\\:") for f in files), "--file_service_type=sequential",
               "--time_based", f"--runtime={seconds}", "--output-format=json"]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()}")
    read = json.loads(out.stdout)["jobs"][0]["read"]
    return read["io_bytes"] / (read["runtime"] / 1e3)


def aligned_buffer(huge):
    """An 8 MiB buffer for O_DIRECT reads: private anonymous memory (a shared mapping, Python's
    default, is shmem, which gets no transparent huge pages), 2 MiB-aligned, advised to be backed
    by huge pages or not to be. Returns the mapping (to close) and the buffer's view."""
    memory = mmap.mmap(-1, BLOCK + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = -ctypes.addressof(ctypes.c_char.from_buffer(memory)) % HUGE_PAGE
    memory.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    return memory, memoryview(memory)[skip:skip + BLOCK]


def python_bound(files, seconds, huge, threads=16):
    """The reads without fio: `threads` threads of os.preadv with O_DIRECT, each into its own 8 MiB
    buffer of huge pages or of 4 KiB pages (aligned_buffer), taking the shards' 8 MiB blocks in
    order, over and over, until `seconds` have passed."""
    fds = [os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files]
    blocks = [(fd, offset) for fd in fds for offset in range(0, os.fstat(fd).st_size, BLOCK)]
    lock, state = threading.Lock(), {"next": 0, "bytes": 0}
    start = time.perf_counter()

    def reader():
        memory, buffer = aligned_buffer(huge)
        done = 0
        while time.perf_counter() - start < seconds:
            with lock:
                fd, offset = blocks[state["next"] % len(blocks)]
                state["next"] += 1
            done += os.preadv(fd, [buffer], offset)
        with lock:
            state["bytes"] += done
        buffer.release()
        memory.close()
    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    for fd in fds:
        os.close(fd)
    return state["bytes"] / elapsed, state["bytes"], elapsed


def read_bound(files, seconds, fio=""):
    """The disk's read bound on `files`: the best of the Python reader into huge pages, the same
    into 4 KiB pages, and fio (when given), each reading for `seconds`. Where each request's
    pages are scattered, a virtual disk can take several times longer to fill 4 KiB pages than
    huge ones (254 segments a request), and fio's buffers are 4 KiB pages; the bound is what the
    disk gives the best reader. Returns (bytes per second, {reader: bytes per second})."""
    figures = {}
    for huge in (True, False):
        figures["python, huge pages" if huge else "python, 4 KiB pages"] = python_bound(files, seconds, huge)[0]
    if fio:
        figures["fio"] = fio_bound(fio, files, seconds)
    return max(figures.values()), figures


# --- running a contender ------------------------------------------------------------------------

CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times():
    """The machine's CPU time so far, in ticks: /proc/stat's "cpu" line, {field: ticks}."""
    with open("/proc/stat") as f:
        return dict(zip(CPU_FIELDS, map(int, f.readline().split()[1:len(CPU_FIELDS) + 1])))


def cpu_shares(before, after):
    """Of the machine's CPU time between two cpu_times(): the share a hypervisor ran something else
    on its CPUs (steal: a virtual disk's work can run on the cores behind a VM's vCPUs, and the
    guest counts that time as its own) and the share idle waiting on reads (iowait)."""
    delta = {k: after[k] - before[k] for k in CPU_FIELDS}
    total = sum(delta.values()) or 1
    return {"steal": delta["steal"] / total, "iowait": delta["iowait"] / total}


def run_measured(command, log, cap=None):
    """Runs `command` with its output in `log`, in the memory cgroup `cap` when given, with no GPU
    visible (the contenders compute on the CPU; accelerate's device map would take a GPU): exit
    code, wall seconds from start to exit, the child's own rusage (wait4: ru_inblock and
    ru_oublock count its reads and writes below the page cache, in 512-byte blocks), and the
    machine's cpu_shares() over the run."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with open(log, "w") as out:
        before, start = cpu_times(), time.perf_counter()
        process = subprocess.Popen([str(c) for c in command], stdout=out, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=cap.enter if cap else None)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        shares = cpu_shares(before, cpu_times())
    process.returncode = os.waitstatus_to_exitcode(status)
    killed = vram_bench.killed_by(cap, process.returncode)
    if killed:
        Path(log).write_text(Path(log).read_text(errors="replace") + killed + "\n")
    return process.returncode, wall, usage, shares


def last_lines(log, n=3):
    lines = [line for line in Path(log).read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-n:]) or "no output"


def write_vramd_configs(workdir, name, folder, vram):
    daemon = workdir / "vramd.toml"
    daemon.write_text('[budgets]\ncpu = "64GiB"\n')
    config = workdir / f"{name}.toml"
    config.write_text(f'checkpoint = "{folder}"\ndtype = "bfloat16"\n{vram}')
    return daemon, config


def vramd_run(vramctl, workdir, name, folder, vram, inputs, forwards, extra=(), cap=None):
    """One `vramctl run` in a fresh process (in the memory cgroup `cap`, when given): its stats
    (plus wall, disk bytes, CPU shares, logits file), or None and the error."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")
    daemon, config = write_vramd_configs(workdir, slug, folder, vram)
    stats, logits, log = workdir / f"stats-{slug}.json", workdir / f"logits-{slug}.safetensors", workdir / f"{slug}.log"
    for stale in (stats, logits):
        stale.unlink(missing_ok=True)
    code, wall, usage, shares = run_measured([vramctl, "run", config, "--daemon-config", daemon, "--input", inputs,
                                              "--output", logits, "--stats-json", stats, "--repeat", forwards,
                                              *extra], log, cap)
    if code != 0:
        return None, f"exit status {code}: {last_lines(log)}"
    s = json.loads(stats.read_text())
    v = s.get("vram", {})
    forwards = s["forwards"]
    return {"wall": wall, "load": s["plan_seconds"] + s["load_seconds"],
            "forward": s["forward_first_seconds"] if forwards == 1 else s["forward_median_seconds"],
            "forward_first": s["forward_first_seconds"], "peak_rss": s["peak_rss"],
            "disk_read": usage.ru_inblock * 512, "disk_written": usage.ru_oublock * 512,
            "streamed": v.get("bytes_streamed", 0) / forwards, "waited": v.get("wait_seconds", 0) / forwards,
            "read_seconds": v.get("read_seconds", 0) / forwards, "mapped": v.get("bytes_mapped", 0) / forwards,
            "peak_weights": v.get("peak"), "plan": v.get("plan", ""), "logits": logits, **shares}, None


def accelerate_contender(spec):
    """Runs in its own process (--contender): from_pretrained with the layers beyond the limit on
    "disk", then the forwards; writes its figures as JSON and its logits as safetensors."""
    def io(key):
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    ids = load_file(spec["inputs"])["input_ids"]
    read_before = io("read_bytes")
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["folder"], device_map="auto", max_memory={"cpu": spec["limit"]}, offload_folder=spec["offload"],
        dtype=torch.bfloat16)
    load = time.perf_counter() - start
    read_loaded = io("read_bytes")
    model.eval()
    times = []
    with torch.no_grad():
        for _ in range(spec["forwards"]):
            start = time.perf_counter()
            logits = model(input_ids=ids).logits
            times.append(time.perf_counter() - start)
    read_end = io("read_bytes")
    save_file({"logits": logits.contiguous()}, spec["logits"])
    placed = {}  # bytes of parameters per device of the device map
    for module_name, device in model.hf_device_map.items():
        module = model.get_submodule(module_name) if module_name else model
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        placed[str(device)] = placed.get(str(device), 0) + nbytes
    Path(spec["result"]).write_text(json.dumps({
        "load": load, "times": times, "peak_rss": vram_bench.status_bytes("VmHWM:"),
        "read_during_load": read_loaded - read_before, "read_during_forwards": read_end - read_loaded,
        "device_map": placed, "versions": {m.__name__: m.__version__ for m in (torch, transformers)}}))


def accelerate_run(workdir, folder, limit, inputs, forwards, cap=None):
    spec = {"folder": str(folder), "limit": limit, "inputs": str(inputs), "forwards": forwards,
            "offload": str(workdir / "accelerate-offload"), "logits": str(workdir / "logits-accelerate.safetensors"),
            "result": str(workdir / "result-accelerate.json")}
    for stale in (spec["logits"], spec["result"]):
        Path(stale).unlink(missing_ok=True)
    code, wall, usage, shares = run_measured([sys.executable, __file__, "--contender", json.dumps(spec)],
                                             workdir / "accelerate.log", cap)
    if code != 0:
        return None, f"exit status {code}: {last_lines(workdir / 'accelerate.log')}"
    r = json.loads(Path(spec["result"]).read_text())
    offload = Path(spec["offload"])
    forward = r["times"][0] if forwards == 1 else statistics.median(r["times"][1:])
    return {"wall": wall, "load": r["load"], "forward": forward, "forward_first": r["times"][0],
            "peak_rss": r["peak_rss"], "disk_read": usage.ru_inblock * 512, "disk_written": usage.ru_oublock * 512,
            "streamed": r["read_during_forwards"] / forwards, "read_during_load": r["read_during_load"],
            "offload_folder_bytes": sum(f.stat().st_size for f in offload.rglob("*") if f.is_file()),
            "device_map": r["device_map"], "versions": r["versions"],
            "logits": Path(spec["logits"]), **shares}, None


# --- the compute estimate -----------------------------------------------------------------------

def compute_estimate(shape, vramctl, workdir, inputs, shard_bytes, fits):
    """Resident forwards (vramctl --copy, median of 3, outside any memory cap) of the model itself
    where it `fits` in memory, else of checkpoints of this shape with 4 and 12 layers (see the
    module's doc): (compute, {layers: seconds}, per layer, fixed)."""
    seconds = {}
    counts = {shape["layers"]} if fits else {min(4, shape["layers"]), min(12, shape["layers"])}
    for layers in sorted(counts):
        folder = checkpoint_folder(workdir, {**shape, "layers": layers})
        make_checkpoint(folder, {**shape, "layers": layers}, shard_bytes)
        r, error = vramd_run(vramctl, workdir, f"resident {layers} layers", folder, "", inputs, 3, ["--copy"])
        evict(shard_files(folder))
        if not r:
            raise RuntimeError(f"the resident {layers}-layer forward failed: {error}")
        seconds[layers] = r["forward"]  # vramctl's median of the 3
        print(f"  resident, {layers} layers: {r['forward']:.3f} s a forward; of the machine's CPU time, "
              f"{r['steal']:.1%} stolen by the host", flush=True)
    (a, ta), (b, tb) = min(seconds.items()), max(seconds.items())
    per_layer = (tb - ta) / (b - a) if b > a else 0.0  # one checkpoint: the model itself
    fixed = ta - a * per_layer
    return fixed + shape["layers"] * per_layer, seconds, per_layer, fixed


# --- the machine --------------------------------------------------------------------------------

def machine(folder):
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    mem = vram_bench.status_bytes("MemTotal:", "/proc/meminfo")
    df = subprocess.run(["df", "--output=source,fstype", str(folder)], capture_output=True, text=True).stdout.split()
    return {"cpu": model, "cores": os.cpu_count(), "memory": mem, "disk": " ".join(df[-2:]) if len(df) >= 4 else "?"}


# --- printing -----------------------------------------------------------------------------------

def print_contender(name, r, size):
    first = f" (first {r['forward_first']:.2f} s)" if r["forward_first"] != r["forward"] else ""
    waited = f", waited on reads {r['waited']:.2f} s" if "waited" in r else ""
    print(f"{name}: wall {r['wall']:.2f} s, load {r['load']:.2f} s, forward {r['forward']:.2f} s{first}{waited}, "
          f"peak RSS {r['peak_rss'] / GIB:.2f} GiB, disk read {gb(r['disk_read'])} written {gb(r['disk_written'])}, "
          f"streamed {gb(r['streamed'])} a forward = {r['streamed'] / r['forward'] / 1e9:.3f} GB/s over the forward; "
          f"of the machine's CPU time, {r['steal']:.1%} stolen by the host, {r['iowait']:.1%} idle on reads")
    if "plan" in r:
        speed = r["streamed"] / r["read_seconds"] / 1e9 if r["read_seconds"] else 0
        print(f"  {speed:.3f} GB/s over its read_seconds ({r['read_seconds']:.2f} s a forward); {gb(r['mapped'])} "
              f"mapped; peak weights {r['peak_weights'] / GIB:.3f} GiB; plan: {r['plan']}")
    else:
        rewritten = r["offload_folder_bytes"] > size // 10
        print(f"  {r['versions']}; device map: {', '.join(f'{gb(n)} on {d}' for d, n in r['device_map'].items())}; "
              f"read during load {gb(r['read_during_load'])}; the offload folder holds {r['offload_folder_bytes']} "
              f"bytes: {'offloaded weights rewritten' if rewritten else 'read straight from the shards'}")
    sys.stdout.flush()


def compare_logits(results):
    """Every contender's logits against the first vramd run's: {name: bit-exact}, and that name."""
    import torch
    from safetensors.torch import load_file
    print("logits (WORKDIR/logits-*.safetensors):")
    reference_name = next((n for n in results if n in DIRECT_IO), None)
    if not reference_name:
        print("  no vramd run to compare with")
        return {}, None
    reference = load_file(results[reference_name]["logits"])["logits"]
    print(f"  reference: {reference_name}, {reference.dtype} {tuple(reference.shape)}, "
          f"max |logit| {reference.float().abs().max().item():.4g}")
    equal = {}
    for name, r in results.items():
        if name == reference_name:
            continue
        logits = load_file(r["logits"])["logits"]
        equal[name] = logits.dtype == reference.dtype and torch.equal(logits, reference)
        diff = (logits.float() - reference.float()).abs().max().item()
        expected = "expected bit-exact" if name in DIRECT_IO else "bit for bit in the issue"
        print(f"  {name}: {'EQUAL bit for bit' if equal[name] else 'DIFFERENT'} ({logits.dtype}), "
              f"max abs difference {diff:.4g} ({expected})")
    return equal, reference_name


# Steal time from which the goals say the host shared the run (the development VM: 0.3% while it
# only computes, 11-22% while it reads the disk as well).
STEAL_NOTED = 0.02


def print_goals(results, errors, bound, compute):
    def verdict(ok):
        return "met" if ok else "NOT met"
    print("goals:")
    accelerate = results.get("accelerate")
    for name in (n for n in DIRECT_IO if n in results):
        r = results[name]
        efficiency = r["streamed"] / r["forward"] / bound
        read_time = r["streamed"] / bound
        overlap = r["forward"] / max(read_time, compute)
        print(f"  {name}: reads at {efficiency:.2f} of the bound (goal >= 0.90: {verdict(efficiency >= 0.9)}); "
              f"forward {r['forward']:.2f} s / max(read {read_time:.2f} s, compute {compute:.2f} s) = {overlap:.2f} "
              f"(goal <= 1.10: {verdict(overlap <= 1.1)})")
        if r["steal"] >= STEAL_NOTED:
            print(f"    the host stole {r['steal']:.1%} of the CPUs' time while it ran (compute was measured with "
                  f"no reads): the forward's goal measures the host here as well as vramd")
        if accelerate:
            print(f"    wall {accelerate['wall'] / r['wall']:.2f}x faster than accelerate's "
                  f"(goal >= 2: {verdict(accelerate['wall'] >= 2 * r['wall'])}); "
                  f"peak RSS {r['peak_rss'] / accelerate['peak_rss']:.2f}x accelerate's "
                  f"(goal <= 1: {verdict(r['peak_rss'] <= accelerate['peak_rss'])})")
    auto = "vramd direct_io=auto"
    pair = [results[n]["forward"] for n in ("vramd direct_io=true", "vramd direct_io=false") if n in results]
    if auto in results and pair:
        ratio = results[auto]["forward"] / min(pair)
        print(f"  {auto}: forward {ratio:.2f}x the better of true and false (goal <= 1.00: {verdict(ratio <= 1)})")
    elif auto in errors:
        print(f"  {auto}: did not run ({errors[auto]})")


def print_table(names, results, errors, equal, reference_name, bound):
    print("| contender | wall | load | forward | waited on reads | peak RSS | read from disk | streamed a forward "
          "| effective read | of the bound | stolen | logits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        if name in errors:
            print(f"| {name} | failed: {errors[name].replace('|', '/')} | | | | | | | | | | |")
        if name not in results:
            continue
        r = results[name]
        effective = r["streamed"] / r["forward"]
        waited = f"{r['waited']:.2f} s" if "waited" in r else "n/a"
        logits = ("reference" if name == reference_name else "" if name not in equal
                  else "equal" if equal[name] else "differ")
        print(f"| {name} | {r['wall']:.1f} s | {r['load']:.2f} s | {r['forward']:.2f} s | {waited} | "
              f"{r['peak_rss'] / GIB:.2f} GiB | {gb(r['disk_read'])} | {gb(r['streamed'])} | "
              f"{effective / 1e9:.2f} GB/s | {effective / bound:.2f} | {r['steal']:.1%} | {logits} |")


# --- main ---------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/vramd-stream", help="checkpoints, configs, logits, logs")
    parser.add_argument("--vramctl", default=str(ROOT / "build" / "bin" / "vramctl"), help="default: ROOT/build/bin")
    parser.add_argument("--tokens", type=int, default=16, help="input ids in the one sequence")
    parser.add_argument("--forwards", type=int, default=1, help="per contender; more: median of all but the first")
    parser.add_argument("--limit", type=parse_size, default=parse_size("2GiB"),
                        help='[vram] limit of the vramd runs and accelerate\'s max_memory["cpu"] (default 2GiB)')
    parser.add_argument("--layers", type=int, default=40, help="decoder layers (the shape: LLaMA-13B by default)")
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--intermediate", type=int, default=13824)
    parser.add_argument("--heads", type=int, default=0, help="attention heads (default: hidden / 128)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", type=parse_size, default=parse_size("700MB"),
                        help="most bytes in a shard (default 700MB: 41 shards of 635 MB on average, as in the issue)")
    parser.add_argument("--bound-seconds", type=int, default=10, help="how long each reader of the read bound reads")
    parser.add_argument("--fio", default=shutil.which("fio") or "", help='fio to run as well ("": none)')
    parser.add_argument("--only", default="", help="run only the contenders whose name contains this")
    parser.add_argument("--memory-cap", type=parse_size, default=0,
                        help="run every contender in a memory cgroup of this size, page cache included (e.g. 8GiB): "
                             "a machine with more memory than the checkpoint then has less than it")
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        return accelerate_contender(json.loads(args.contender))
    cap = None
    if args.memory_cap:
        try:
            cap = vram_bench.MemoryCap(args.memory_cap)
        except OSError as e:
            parser.error(f"--memory-cap: cannot make a memory cgroup of {args.memory_cap} bytes here: {e}")
    try:
        run(args, cap)
    finally:
        if cap:
            cap.close()


def run(args, cap):
    import torch
    from safetensors.torch import save_file
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    vramctl = Path(args.vramctl).resolve()
    shape = {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
             "heads": args.heads or args.hidden // 128, "vocab": args.vocab}
    folder = checkpoint_folder(workdir, shape)
    print(f"checkpoint: {folder}", flush=True)
    make_checkpoint(folder, shape, args.shard_size)
    files = shard_files(folder)
    size = sum(f.stat().st_size for f in files)
    info = machine(folder)
    print(f"  {len(files)} shards, {size / GIB:.2f} GiB; limit {args.limit / GIB:.3f} GiB; {args.tokens} tokens, "
          f"{args.forwards} forward(s) per contender", flush=True)
    memory, which = (cap.nbytes, "the memory cap") if cap else (info["memory"], "MemTotal")
    if size < memory:
        print(f"WARNING: the checkpoint ({size / GIB:.2f} GiB) is smaller than {which} "
              f"({memory / GIB:.2f} GiB): it is not larger than memory, not the issue's case", flush=True)
    inputs = workdir / f"inputs-{args.tokens}-v{args.vocab}.safetensors"
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, inputs)

    # 1. The read bound.
    evict(files)
    bound, readers = read_bound(files, args.bound_seconds, args.fio if args.fio and Path(args.fio).exists() else "")
    bound_tool = max(readers, key=readers.get)
    print(f"read bound: {bound / 1e9:.3f} GB/s, the best of "
          + ", ".join(f"{name} {rate / 1e9:.3f}" for name, rate in readers.items())
          + f" (16 O_DIRECT reads of 8 MiB in flight, {args.bound_seconds} s each)", flush=True)

    # 2. Compute with the same layers resident: the model's own forward where it fits in memory, else
    # estimated from 4 and 12 layers.
    fits = size * 5 // 4 + 2 * GIB < vram_bench.status_bytes("MemAvailable:", "/proc/meminfo")
    compute, measured, per_layer, fixed = compute_estimate(shape, vramctl, workdir, inputs, args.shard_size, fits)
    if fits:
        compute_text = f"compute {compute:.2f} s (the model's own forward, every layer resident)"
        print(f"compute: {compute:.3f} s, the model's own forward with every layer resident (--copy, median of 3; "
              f"it fits in memory)", flush=True)
    else:
        compute_text = f"compute estimate {compute:.2f} s (fixed {fixed:.3f} s + {per_layer:.3f} s a layer)"
        print(f"compute estimate: {compute:.3f} s for {args.layers} layers resident = fixed {fixed:.3f} s + "
              f"{args.layers} x {per_layer:.3f} s a layer, from resident vramd forwards (--copy, median of 3) of "
              f"this shape with " + " and ".join(f"{n} layers ({t:.3f} s)" for n, t in measured.items()), flush=True)

    # 3. The contenders, each in a fresh process, the checkpoint evicted before each.
    results, errors = {}, {}
    names = [name for name in DIRECT_IO if name != AT_ACCELERATES] + ["accelerate", AT_ACCELERATES]
    for name in names:
        if args.only and args.only not in name:
            continue
        limit = args.limit
        if name == AT_ACCELERATES:
            if "accelerate" not in results:
                continue
            limit = results["accelerate"]["device_map"].get("cpu", 0)
            if limit == 0:
                errors[name] = "accelerate kept no weights on the CPU: nothing to compare at equal bytes"
                continue
        evict(files)
        if name in DIRECT_IO:
            vram = (vram_bench.streamed_vram(limit) + 'computation = { device = "cpu", dtype = "bfloat16" }\n'
                    f"direct_io = {DIRECT_IO[name]}\n")
            r, error = vramd_run(vramctl, workdir, name, folder, vram, inputs, args.forwards, cap=cap)
        else:
            r, error = accelerate_run(workdir, folder, args.limit, inputs, args.forwards, cap)
        if r:
            results[name] = r
            print_contender(name, r, size)
        else:
            errors[name] = error
            print(f"{name}: failed: {error}", flush=True)
    evict(files)

    # 4. Logits, goals, and the table for docs/benchmarks.md.
    equal, reference_name = compare_logits(results)
    print_goals(results, errors, bound, compute)
    cap_text = f", every contender in a memory cgroup of {cap.nbytes / GIB:.2f} GiB (page cache included)" if cap else ""
    print(f"\nmachine: {info['cpu']}, {info['cores']} cores, MemTotal {info['memory'] / GIB:.1f} GiB, "
          f"disk {info['disk']}\n")
    print(f"{len(files)} shards, {size / GIB:.2f} GiB bfloat16 (hidden {shape['hidden']}, intermediate "
          f"{shape['intermediate']}, {shape['layers']} layers, vocab {shape['vocab']}), "
          f"limit {args.limit / GIB:.3f} GiB, {args.tokens} tokens, {args.forwards} forward(s) per contender, "
          f"page cache emptied before each{cap_text}. Read bound "
          f"{bound / 1e9:.2f} GB/s ({bound_tool}); {compute_text}.\n")
    print_table(names, results, errors, equal, reference_name, bound)


if __name__ == "__main__":
    main()
