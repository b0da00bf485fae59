"""Streaming under a memory limit: a ~1B-parameter LLaMA-shaped bfloat16 checkpoint (random
weights; bench/load.py makes it), offloaded to disk, limit a quarter of the model, CPU as the
computation device. Every contender runs in a fresh process on the same file, page cache warm.

    .venv/bin/python bench/vram.py [--workdir /tmp/vramd-bench] [--forwards 20] [--tokens 32]
                                   [--memory-cap GIB] [--only NAME]

  vramd resident   the whole model in memory: pure compute time
  vramd streamed   [vram] offload = onload = disk, limit = size / 4
  vramd direct     the same with direct_io = true (O_DIRECT reads, around the page cache)
  vramd tiered     the same with onload = cpu and onload_limit = size / 2: host, then disk
  accelerate disk  load_checkpoint_and_dispatch with the decoder layers on "disk" (its offload
                   folder of memory-mapped weights), everything else on the CPU
  diffsynth disk   DiffSynth-Studio's enable_vram_management on the transformers model: every
                   Linear, Embedding and RMSNorm wrapped, offload = onload = "disk" (its DiskMap
                   over the checkpoint), preparing = computation = cpu bfloat16 (see
                   diffsynth_contender for why its vram_limit is never consulted on the CPU).
                   Optional: pip install --no-deps -r bench/requirements.txt

Prints forward latency (median of the forwards after the first), peak RSS, RSS growth over the
run, vramd's peak weight bytes on the computation device against its limit, and the overlap
efficiency: streamed forward time over max(pure read time, pure compute time), where pure read
time is reading the streamed bytes with positioned reads alone, measured in the same run.
DiffSynth's peak weight bytes are counted from outside (see diffsynth_contender);
--diffsynth-trace FILE writes its last forward in the format of `vramctl run --trace`, for
bench/plot_vram.py.

--memory-cap GIB runs every contender in a memory cgroup of that size (root and cgroup v1 or v2
needed), which counts the page cache with the process's own memory: a machine whose memory
cannot keep the checkpoint cached. The checkpoint is then evicted from the page cache before
each contender instead of warmed, and the pure read time is taken cold. A contender that needs
more than the cap is killed and reported so.
"""
import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VRAMCTL = ROOT / "build" / "bin" / "vramctl"
sys.path.insert(0, str(ROOT / "bench"))
import load as load_bench  # noqa: E402  (makes the checkpoint)


def status_bytes(key, path="/proc/self/status"):
    """A "Key:  N kB" line's bytes: of this process's status, or of /proc/meminfo."""
    with open(path) as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024


class MemoryCap:
    """A memory cgroup capped at `nbytes` (page cache included) for the contenders' processes."""

    def __init__(self, nbytes):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        self.path = Path("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory") / f"vramd-bench-{os.getpid()}"
        self.path.mkdir()
        try:  # v2 without the memory controller given to the new group has no memory.max
            (self.path / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(nbytes))
        except OSError:
            self.path.rmdir()
            raise
        self.nbytes = nbytes

    def enter(self):
        """A preexec_fn: moves the child into the cgroup before it runs."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self):
        self.path.rmdir()


def evict(path):
    """Drops the file's pages from the page cache (it is clean: nothing is lost)."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def answering(daemon, sock, log):
    """A client of the daemon process `daemon` once it answers on `sock`: its health is asked
    until it answers (SystemExit with log() if it exits, or has not answered in 60 s)."""
    sys.path.insert(0, str(ROOT / "python"))
    import vramd
    deadline = time.monotonic() + 60
    while True:
        try:
            client = vramd.connect(sock)
            client.health()
            return client
        except vramd.DaemonUnreachable:
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise SystemExit(f"vramd did not start: {log()}") from None
            time.sleep(0.05)


@contextlib.contextmanager
def serving(work, budgets, binary=ROOT / "build" / "bin" / "vramd", extra=""):
    """A vramd daemon serving the model folder WORK/models (its log WORK/vramd.log) under the
    [budgets] entries `budgets` (and the daemon config's lines `extra`), and a client connected
    to it, until the block ends."""
    sys.path.insert(0, str(ROOT / "python"))
    import vramd
    sock = work / "vramd.sock"
    sock.unlink(missing_ok=True)
    (work / "vramd.toml").write_text(f'socket = "{sock}"\nmodels = "models"\n{extra}\n[budgets]\n{budgets}\n')
    with open(work / "vramd.log", "wb") as log:
        daemon = subprocess.Popen([binary, "--config", str(work / "vramd.toml")], stdout=log, stderr=subprocess.STDOUT)
        try:
            client = answering(daemon, sock, lambda: (work / "vramd.log").read_text())
            try:
                yield client
            finally:
                client.close()
        finally:
            daemon.terminate()
            daemon.wait(60)


def killed_by(cap, returncode):
    """The error for a contender that the memory cap killed, else None."""
    if cap and returncode in (-9, 137):
        return f"killed: needs more than the {cap.nbytes / 2**30:.2f} GiB memory cap"
    return None


def accelerate_contender(folder, tokens, forwards, offload_dir):
    import torch
    import accelerate
    import transformers
    folder = Path(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" for i in range(config.num_hidden_layers)})
    model = accelerate.load_checkpoint_and_dispatch(model, str(folder / "model.safetensors"), device_map=device_map,
                                                    offload_folder=offload_dir, dtype=torch.bfloat16)
    model.eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    times, rss_first = [], None
    with torch.no_grad():
        for i in range(forwards):
            start = time.perf_counter()
            model(input_ids=ids)
            times.append(time.perf_counter() - start)
            if i == 0:
                rss_first = status_bytes("VmRSS:")
    return {"times": times, "peak_rss": status_bytes("VmHWM:"), "rss_growth": status_bytes("VmRSS:") - rss_first}


DIFFSYNTH_MISSING = "diffsynth: not installed (pip install --no-deps -r bench/requirements.txt)"


def import_diffsynth_vram():
    """DiffSynth-Studio's VRAM management (diffsynth.core.vram.layers) from the installed package,
    or None if it is not installed.

    `import diffsynth` runs the package's __init__, which imports the whole library (pipelines,
    data loaders, model downloads: torchvision, imageio, pandas, modelscope, cryptography, ...,
    about 200 MB that the benchmark never uses). The vram modules themselves need only torch and
    safetensors, so the two parent packages are registered as bare packages pointing at the
    installed folders, and the installed diffsynth/core/vram/*.py and diffsynth/core/device/*.py
    run unchanged.
    """
    import importlib
    if "diffsynth.core.vram.layers" in sys.modules:
        return sys.modules["diffsynth.core.vram.layers"]
    spec = importlib.util.find_spec("diffsynth")
    if spec is None or not spec.submodule_search_locations:
        return None
    for name, sub in [("diffsynth", ()), ("diffsynth.core", ("core",))]:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(location, *sub) for location in spec.submodule_search_locations]
            package.__package__ = name
            sys.modules[name] = package
    return importlib.import_module("diffsynth.core.vram.layers")


def diffsynth_managed(model, wrappers, device, dtype, limit):
    """`model`, its weights at rest in bfloat16 in host memory, under DiffSynth-Studio's
    enable_vram_management: the modules of each class in `wrappers` wrapped by the layers' class
    of that name (nn.Linear: "AutoWrappedLinear"), computed on `device` in `dtype`; on a GPU its
    vram_limit lets the device hold `limit` bytes more than it does now (DiffSynth limits what is
    in use on the whole device). Returns the model and DiffSynth's layers module."""
    import torch
    layers = import_diffsynth_vram()
    if layers is None:
        raise RuntimeError(DIFFSYNTH_MISSING)
    states = {"offload_dtype": torch.bfloat16, "offload_device": "cpu", "onload_dtype": torch.bfloat16,
              "onload_device": "cpu", "preparing_dtype": dtype, "preparing_device": device,
              "computation_dtype": dtype, "computation_device": device}
    vram_limit = None
    if torch.device(device).type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        vram_limit = (total - free + limit) / (1 << 30)
    module_map = {cls: getattr(layers, name) for cls, name in wrappers.items()}
    return layers.enable_vram_management(model, module_map, states, vram_limit=vram_limit), layers


def diffsynth_contender(folder, tokens, forwards, limit, trace=False):
    """DiffSynth-Studio's disk offload of the transformers model. Runs in its own process.

    How it is applied (diffsynth 2.1.12, as its own loader `load_model` does for a disk offload):
    the model is built with `skip_model_initialization` (parameters on meta), a `DiskMap` is
    opened on the checkpoint, and `enable_vram_management(model, module_map, vram_config,
    vram_limit, disk_map)` replaces every torch.nn.Linear by an AutoWrappedLinear and every
    Embedding and LlamaRMSNorm by an AutoWrappedModule. With offload = onload = "disk" a wrapper
    reads its weights through the DiskMap (safetensors `get_tensor`, then a clone) on each call
    and drops them when the call returns; nothing stays loaded between calls.

    vram_limit (GiB) is passed as a quarter of the model but never consulted here: DiffSynth reads
    it only for layers in the "onload" state (its pipelines call onload() on every layer before
    running a model), where each call first asks the device's used memory through
    torch.<device>.mem_get_info, then keeps the layer resident ("preparing") while that is under
    the limit. torch.cpu has no mem_get_info, so on a CPU computation device onload() plus a
    limit fails, and onload() without a limit keeps every layer resident (no limit at all). The
    layers are therefore left in the "offload" state: every call streams from disk, which is
    what DiffSynth does on a GPU once its limit is reached (or with vram_limit=0), its lowest
    setting.

    Peak weight bytes on the computation device (the CPU, so the same memory as everything else):
    DiffSynth does not count them, so they are counted from outside. A forward pre-hook and a
    forward hook on every wrapper bracket its call; the bytes of the tensors the DiskMap returns
    during the call are held from the read to the wrapper's return (AutoWrappedLinear's weights
    are locals of its forward, AutoWrappedModule's a deep copy of the layer, both dropped then),
    plus any parameter not on meta (none: every weight-holding module is wrapped). safetensors'
    own tensor, which the DiskMap clones, lives a moment longer and is not counted.
    """
    import torch
    import transformers
    folder = Path(folder)
    layers = import_diffsynth_vram()
    from diffsynth.core.vram.disk_map import DiskMap
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    config = transformers.AutoConfig.from_pretrained(folder)
    with layers.skip_model_initialization():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    held = {"now": 0, "peak": 0, "read": 0}
    calls = []  # bytes read by each wrapper call in progress (innermost last)
    events = []
    clock = {"start": time.perf_counter()}

    class CountingDiskMap(DiskMap):
        def __getitem__(self, name):
            tensor = super().__getitem__(name)
            nbytes = tensor.numel() * tensor.element_size()
            held["read"] += nbytes
            if calls:
                calls[-1] += nbytes
                held["now"] += nbytes
                held["peak"] = max(held["peak"], held["now"])
                if trace:
                    events.append([time.perf_counter() - clock["start"], held["now"], name, "acquire"])
            return tensor

    disk_map = CountingDiskMap(str(folder / "model.safetensors"), "cpu")
    module_map = {torch.nn.Linear: layers.AutoWrappedLinear, torch.nn.Embedding: layers.AutoWrappedModule,
                  LlamaRMSNorm: layers.AutoWrappedModule}
    vram_config = {"offload_dtype": "disk", "offload_device": "disk", "onload_dtype": "disk", "onload_device": "disk",
                   "preparing_dtype": torch.bfloat16, "preparing_device": "cpu",
                   "computation_dtype": torch.bfloat16, "computation_device": "cpu"}
    model = layers.enable_vram_management(model, module_map, vram_config, vram_limit=limit / 2**30, disk_map=disk_map)

    wrappers = [(name, m) for name, m in model.named_modules() if isinstance(m, layers.AutoTorchModule)]
    assert all(m.disk_offload and m.state == 0 for _, m in wrappers), "every wrapper offloaded to disk"

    def before(module, args, kwargs=None):
        calls.append(0)

    def after(name):
        def hook(module, args, output):
            nbytes = calls.pop()
            held["now"] -= nbytes
            if trace and nbytes:
                events.append([time.perf_counter() - clock["start"], held["now"], name, "release"])
        return hook
    for name, m in wrappers:
        m.register_forward_pre_hook(before)
        m.register_forward_hook(after(name))
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    held["now"] = held["peak"] = resident

    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    times, rss_first = [], None
    with torch.no_grad():
        for i in range(forwards):
            held["read"] = 0
            del events[:]
            clock["start"] = start = time.perf_counter()
            model(input_ids=ids)
            times.append(time.perf_counter() - start)
            if i == 0:
                rss_first = status_bytes("VmRSS:")
    out = {"times": times, "peak_rss": status_bytes("VmHWM:"), "rss_growth": status_bytes("VmRSS:") - rss_first,
           "peak_weights": held["peak"], "resident_weights": resident, "bytes_read_per_forward": held["read"],
           "wrapped": {cls.__name__: sum(isinstance(m, cls) for _, m in wrappers)
                       for cls in (layers.AutoWrappedLinear, layers.AutoWrappedModule)},
           "version": importlib.metadata.version("diffsynth")}
    if trace:
        out["trace"] = {"limit": limit, "events": events}
    return out


def python_contender(function, *args, cap=None):
    """Runs bench/vram.py's `function(*args)` (arguments JSON values) in a fresh process: its result,
    or None and the error's last line."""
    script = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'bench')!r}); import vram; "
              f"print(json.dumps(vram.{function}(*json.loads({json.dumps(args)!r}))))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         preexec_fn=cap.enter if cap else None)
    if error := killed_by(cap, out.returncode):
        return None, error
    if out.returncode != 0:
        return None, (out.stderr.strip().splitlines() or ["exit status %d" % out.returncode])[-1]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["forward_median_seconds"] = statistics.median(result["times"][1:] or result["times"])
    return result, None


def streamed_vram(limit):
    """The [vram] section of the streamed contender (bench/plot_vram.py runs the same)."""
    return f'[vram]\noffload = {{ device = "disk" }}\nonload = {{ device = "disk" }}\nlimit = {limit}\n'


def vramd_contender(folder, tokens, forwards, workdir, vram, extra_args=(), cap=None):
    import torch
    from safetensors.torch import save_file
    daemon_config = workdir / "vramd.toml"
    daemon_config.write_text('[budgets]\ncpu = "64GiB"\n')
    config = workdir / "model.toml"
    config.write_text(f'checkpoint = "{folder}"\n{vram}')
    inputs = workdir / "in.safetensors"
    save_file({"input_ids": torch.randint(0, 32000, (1, tokens), generator=torch.Generator().manual_seed(0))}, inputs)
    stats = workdir / "stats.json"
    out = subprocess.run([VRAMCTL, "run", config, "--daemon-config", daemon_config, "--input", inputs,
                          "--stats-json", stats, "--repeat", str(forwards), "--copy", *extra_args],
                         capture_output=True, text=True, preexec_fn=cap.enter if cap else None)
    if error := killed_by(cap, out.returncode):
        return None, error
    if out.returncode != 0:
        return None, out.stderr.strip()
    return json.loads(stats.read_text()), None


def pure_read_seconds(path, nbytes):
    """Positioned reads of `nbytes` of the file into one reused buffer, as cached as it is: the
    read bound (no allocation or page faults counted). Starts over at the beginning at the end of
    the file (more can be streamed per forward than the file holds: a layer evicted and read
    again)."""
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    buffer = memoryview(bytearray(64 << 20))
    start, done = time.perf_counter(), 0
    while done < nbytes:
        offset = 4096 + done % (size - 4096)
        n = os.preadv(fd, [buffer[:min(len(buffer), nbytes - done, size - offset)]], offset)
        if not n:
            raise RuntimeError(f"{path}: nothing read at {offset}")
        done += n
    os.close(fd)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--forwards", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--only", default="", help="run only the contenders whose name contains this")
    parser.add_argument("--diffsynth-trace", default="",
                        help="write DiffSynth's last forward as a trace (the format of vramctl run --trace)")
    parser.add_argument("--memory-cap", type=float, default=0,
                        help="GiB: run every contender in a memory cgroup of this size, page cache included, cold")
    args = parser.parse_args()
    folder = Path(args.workdir) / "llama1b"
    load_bench.make_checkpoint(folder)
    checkpoint = folder / "model.safetensors"
    size = checkpoint.stat().st_size
    limit = size // 4
    cap = MemoryCap(int(args.memory_cap * 2**30)) if args.memory_cap else None

    def start_cache(cold=cap is not None):
        if cold:
            evict(checkpoint)
        else:
            subprocess.run(["cat", checkpoint], stdout=subprocess.DEVNULL, check=True)  # warm the cache
    try:
        run_contenders(args, folder, size, limit, cap, start_cache)
    finally:
        if cap:
            cap.close()


def run_contenders(args, folder, size, limit, cap, start_cache):
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # "tiered": the streamed layers that fit in half the model's size rest in host memory, the
        # rest on disk, as a device map would place them over GPU, host and disk.
        tiered = (f'[vram]\noffload = {{ device = "disk" }}\nonload = {{ device = "cpu" }}\nlimit = {limit}\n'
                  f'onload_limit = {size // 2}\n')
        contenders = [("vramd resident", ""), ("vramd streamed", streamed_vram(limit)),
                      ("vramd direct", streamed_vram(limit) + "direct_io = true\n"), ("vramd tiered", tiered)]
        for name, vram in contenders:
            if args.only and args.only not in name:
                continue
            # Pure compute: resident, warm and uncapped even under --memory-cap, which it would not fit.
            pure = name == "vramd resident"
            start_cache(cold=cap is not None and not pure)
            s, error = vramd_contender(folder, args.tokens, args.forwards, tmp, vram, cap=None if pure else cap)
            if not s:
                print(f"{name}: failed: {error}", flush=True)
                continue
            results[name] = s
            print(f"{name}: forward median {s['forward_median_seconds']:.2f} s (first {s['forward_first_seconds']:.2f} s), "
                  f"peak RSS {s['peak_rss'] / 2**30:.2f} GiB, RSS growth after the first forward "
                  f"{(s['rss_end'] - s['rss_after_first_forward']) / 2**20:.0f} MiB"
                  + (f", peak weights {s['vram']['peak'] / 2**20:.0f} MiB of limit {limit / 2**20:.0f} MiB, "
                     f"{s['vram']['prefetched']}/{s['vram']['loads']} loads prefetched; {s['vram']['plan']}" if "vram" in s else ""),
                  flush=True)
        if not args.only or "accelerate" in args.only:
            start_cache()
            a, error = python_contender("accelerate_contender", str(folder), args.tokens, args.forwards, str(tmp / "offload"),
                                        cap=cap)
            if a:
                results["accelerate disk"] = a
                print(f"accelerate disk: forward median {a['forward_median_seconds']:.2f} s (first {a['times'][0]:.2f} s), "
                      f"peak RSS {a['peak_rss'] / 2**30:.2f} GiB, RSS growth after the first forward "
                      f"{a['rss_growth'] / 2**20:.0f} MiB", flush=True)
            else:
                print("accelerate disk: failed:", error)
        if not args.only or "diffsynth" in args.only:
            if importlib.util.find_spec("diffsynth") is None:
                print(DIFFSYNTH_MISSING, flush=True)
            else:
                start_cache()
                d, error = python_contender("diffsynth_contender", str(folder), args.tokens, args.forwards, limit,
                                            bool(args.diffsynth_trace), cap=cap)
                if d:
                    results["diffsynth disk"] = d
                    if args.diffsynth_trace:
                        Path(args.diffsynth_trace).write_text(json.dumps(d.pop("trace")))
                    print(f"diffsynth disk (diffsynth {d['version']}, offload = onload = disk, layers left offloaded, "
                          f"vram_limit {limit / 2**30:.2f} GiB not consulted on the CPU): forward median "
                          f"{d['forward_median_seconds']:.2f} s (first {d['times'][0]:.2f} s), "
                          f"peak RSS {d['peak_rss'] / 2**30:.2f} GiB, RSS growth after the first forward "
                          f"{d['rss_growth'] / 2**20:.0f} MiB, peak weights {d['peak_weights'] / 2**20:.0f} MiB "
                          f"(counted from outside), {d['bytes_read_per_forward'] / 2**30:.2f} GiB read per forward",
                          flush=True)
                else:
                    print("diffsynth disk: failed:", error)

    read = None
    for name in ("vramd streamed", "vramd direct"):
        if name not in results:
            continue
        s = results[name]
        if "vramd resident" in results:
            if read is None:  # the same bytes for both: one measurement
                start_cache()
                read = pure_read_seconds(folder / "model.safetensors", int(s["vram"]["bytes_streamed"] / max(1, s["forwards"])))
            compute = results["vramd resident"]["forward_median_seconds"]
            print(f"{name}: overlap efficiency {s['forward_median_seconds']:.2f} s over max(read "
                  f"{read:.2f} s{' cold' if cap else ''}, compute {compute:.2f} s) = "
                  f"{s['forward_median_seconds'] / max(read, compute):.2f}")
        peers = {k: results[k]["forward_median_seconds"] for k in ("accelerate disk", "diffsynth disk") if k in results}
        for peer, seconds in peers.items():
            print(f"{name} against {peer}: {seconds / s['forward_median_seconds']:.2f}x faster")
        if peers:
            print(f"{name} against the faster of diffsynth and accelerate: "
                  f"{min(peers.values()) / s['forward_median_seconds']:.2f}x faster"
                  + ("" if len(peers) == 2 else " (only one of them ran)"))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("times", "trace")} for k, v in results.items()}))


if __name__ == "__main__":
    main()
