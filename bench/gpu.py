"""The GPU check's benchmarks (scripts/gpu-check runs them): vramd's paths on one device, each
against a peer or a bound measured in the same run on the same device. A LLaMA-shaped bfloat16
checkpoint of random weights (bench/load.py's 1.1B, or --size small), page cache warm; every
contender runs in a fresh process.

    .venv/bin/python bench/gpu.py [--device cuda:0] [--size 1b|small] [--workdir DIR]
                                  [--forwards 5] [--json FILE] [--deadline UNIX_TIME]
                                  [--only STEP,...]   # those steps alone (STEPS below)

  staging     host to device: vramd's streamed onload from host memory (bytes streamed over the
              time spent bringing them in) against a plain copy of pinned host memory to the
              device (torch's non_blocking .to(): one cudaMemcpyAsync per tensor) of the same
              bytes; disk to device: vramd's onload from disk with direct_io (every forward
              reads the disk, around the page cache, through pinned staging buffers) against
              the disk's read bound on the checkpoint (16 O_DIRECT reads of 8 MiB in flight
              into either page size, the better, as bench/stream.py measures it without fio);
              the staged reads alone, into buffers of 4 KiB pages and of huge pages, and on a
              GPU onto the device through huge pages registered with the driver (vramd's
              staging) and through LibTorch's pinned memory (vramd_bench_storage)
  direct_io   streaming from disk with direct_io "auto" (the default), true and false: auto's
              forward against the better of the other two, and the path its plan chose
  streaming   [vram].limit a quarter of the model, onload on the host and on disk, against
              accelerate (load_checkpoint_and_dispatch, decoder layers on "cpu" or "disk", the
              rest on the device) and DiffSynth-Studio (enable_vram_management, offload on
              the host or disk, vram_limit the same bytes): forward median, vramd's peak weight
              bytes against its limit, the CUDA allocator's own peak
  ready       time to ready on the device: vramctl run's plan and load against transformers'
              from_pretrained(device_map=DEVICE)
  float8      onload resting in float8_e4m3fn, computed in bfloat16, against bfloat16 onload:
              bytes moved to the device and forward median
  sleep/wake  through the daemon: offload (to the host from a GPU; to disk on the CPU) and onload
              again, seconds per GiB
  lease       through the daemon, in a fresh process: a complete state dict on the device from a
              lease of the loaded model against safetensors' load_file(device=DEVICE), seconds
              and the device memory the client's own process grew by
  fast_loaders  on a GPU (issue #70): the whole checkpoint on the device by instanttensor,
              runai-model-streamer and fastsafetensors (nogds), each in a fresh process, against
              vramctl run's load (all resident), from the page cache and cold, in turn; vramd's
              rate against the pinned copy's bound (copy_bound) and the disk's (scripts/gpu-check's
              loaders step: --only read_bound_bytes_per_second,copy_bound,fast_loaders)

With --device cpu the same steps run on the CPU where they mean something (not GPU figures), and
the report lists the others as skipped, with the reason. The streaming peers are accelerate and
DiffSynth-Studio's VRAM management (diffsynth_contender; `pip install --no-deps` of the
diffsynth pinned in bench/requirements.txt, which scripts/setup and the offline pack bring).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VRAMCTL = Path(os.environ.get("VRAMCTL", ROOT / "build" / "bin" / "vramctl"))
VRAMD = Path(os.environ.get("VRAMD", ROOT / "build" / "bin" / "vramd"))
sys.path.insert(0, str(ROOT / "bench"))
import load as load_bench  # noqa: E402  (makes the checkpoint)
import stream as stream_bench  # noqa: E402  (the disk's read bound)

# --deadline: the time (time.time()) by which every step must be done, so that the GPU check
# writes its report inside a lent machine's 10 minutes a command; steps that would start later
# are skipped, saying so, and a contender still running then is stopped.
DEADLINE = None
OUT_OF_TIME = "out of the GPU check's time budget (--deadline)"


def time_left():
    """Seconds a child process may take: until the deadline, at most 1200."""
    return 1200.0 if DEADLINE is None else max(1.0, min(1200.0, DEADLINE - time.time()))


SMALL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
GIB = 1 << 30


def synchronize(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# Contenders that run in a fresh Python process (--contender NAME).

def accelerate_contender(folder, device, where, tokens, forwards, offload_dir):
    """Decoder layers on `where` ("cpu" or "disk"), the rest on `device`, computed on `device`."""
    import torch
    import accelerate
    import transformers
    config = transformers.AutoConfig.from_pretrained(folder)
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    device_map = {name: device for name in ("model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head")}
    device_map.update({f"model.layers.{i}": where for i in range(config.num_hidden_layers)})
    model = accelerate.load_checkpoint_and_dispatch(model, str(Path(folder) / "model.safetensors"),
                                                    device_map=device_map, offload_folder=offload_dir,
                                                    dtype=torch.bfloat16)
    model.eval()
    return timed_forwards(model, config, device, tokens, forwards)


def timed_forwards(model, config, device, tokens, forwards):
    """The median forward (of those after the first) and the CUDA allocator's peak over them."""
    import torch
    ids = (torch.arange(tokens).view(1, tokens) % config.vocab_size).to(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    with torch.inference_mode():
        for _ in range(forwards):
            synchronize(device)
            start = time.perf_counter()
            model(input_ids=ids)
            synchronize(device)
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
    return {"forward_median_seconds": statistics.median(times[1:] or times), "device_peak_allocated": peak}


def diffsynth_contender(folder, device, where, tokens, forwards, limit):
    """DiffSynth-Studio's VRAM management on the transformers model, applied as its pipelines
    apply it: every Linear, Embedding and RMSNorm wrapped (enable_vram_management), offload and
    onload on `where` ("cpu": the weights loaded into host memory first; "disk": read through its
    DiskMap on the checkpoint), preparing and computation on `device` in bfloat16.

    On a GPU every wrapper is onloaded, as DiffSynth's pipelines do before running a model, and
    a layer then moves to the device for good at its first call while the device's used memory
    (torch.cuda.mem_get_info: every process's) is under vram_limit; past it, each call copies
    the layer in and drops it. vram_limit is the memory in use before the model plus `limit`,
    so that the CUDA context does not count against the weights' limit. On the CPU
    (torch.cpu has no mem_get_info, so onload plus a limit fails) the wrappers stay offloaded
    and every call reads its weights, as in bench/vram.py."""
    import torch
    import transformers
    import vram  # bench/vram.py: DiffSynth's VRAM modules without the rest of the package
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    layers = vram.import_diffsynth_vram()
    if layers is None:
        raise RuntimeError(vram.DIFFSYNTH_MISSING)
    from diffsynth.core.vram.disk_map import DiskMap
    gpu = device.startswith("cuda")
    path = str(Path(folder) / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(folder)
    if gpu:
        torch.zeros(1, device=device)  # the CUDA context, before measuring what is in use
    with layers.skip_model_initialization():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    if where == "disk":
        disk_map, rest = DiskMap(path, "cpu"), "disk"
    else:
        from safetensors.torch import load_file
        model.load_state_dict(load_file(path), strict=False, assign=True)
        disk_map, rest = None, torch.bfloat16
    vram_config = {"offload_dtype": rest, "offload_device": where, "onload_dtype": rest, "onload_device": where,
                   "preparing_dtype": torch.bfloat16, "preparing_device": device,
                   "computation_dtype": torch.bfloat16, "computation_device": device}
    vram_limit = None
    if gpu:
        free, total = torch.cuda.mem_get_info(device)
        vram_limit = (total - free + limit) / GIB
    module_map = {torch.nn.Linear: layers.AutoWrappedLinear, torch.nn.Embedding: layers.AutoWrappedModule,
                  LlamaRMSNorm: layers.AutoWrappedModule}
    model = layers.enable_vram_management(model, module_map, vram_config, vram_limit=vram_limit, disk_map=disk_map)
    if gpu:
        for module in model.modules():
            if isinstance(module, layers.AutoTorchModule):
                module.onload()
    figures = timed_forwards(model, config, device, tokens, forwards)
    on_device = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
    return {**figures, "vram_limit_gib": vram_limit, "weights_left_on_device": on_device if gpu else None}


def transformers_ready_contender(folder, device):
    import torch
    import transformers
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=device)
    synchronize(device)
    ready = time.perf_counter() - start
    del model
    return {"ready_seconds": ready}


def copy_bound_contender(folder, device):
    """Every tensor of the checkpoint in pinned host memory, then copied to the device: GB/s."""
    import torch
    from safetensors.torch import load_file
    tensors = [t.pin_memory() for t in load_file(str(Path(folder) / "model.safetensors")).values()]
    total = sum(t.numel() * t.element_size() for t in tensors)
    best = 0.0
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        copies = [t.to(device, non_blocking=True) for t in tensors]
        synchronize(device)
        best = max(best, total / (time.perf_counter() - start))
        del copies
    return {"bytes": total, "bytes_per_second": best}


def state_dict_contender(folder, device, sock):
    """A complete state dict on `device`, from a lease of the daemon at `sock` or (sock empty)
    from load_file: seconds from the call, and how much the device's free memory shrank."""
    import torch
    free = lambda: torch.cuda.mem_get_info(device)[0] if device.startswith("cuda") else 0  # noqa: E731
    torch.zeros(1, device=device)  # a CUDA context is no part of either's cost
    before = free()
    start = time.perf_counter()
    if sock:
        import vramd
        lease = vramd.connect(sock).lease("bench", device=device)  # held until the process ends
        state_dict = lease.state_dict
    else:
        from safetensors.torch import load_file
        state_dict = load_file(str(Path(folder) / "model.safetensors"), device=device)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tensors": len(state_dict), "device_bytes_grown": before - free(),
            "bytes": sum(t.numel() * t.element_size() for t in state_dict.values())}


# The fastest loaders serving stacks use (issue #70), each timed putting the whole checkpoint on
# the device: installed from bench/requirements.txt (scripts/pack-offline packs them).
FAST_LOADERS = ("instanttensor", "runai", "fastsafetensors")


def fast_loader_contender(which, folder, device):
    """`which` putting every tensor of the checkpoint on `device` in this fresh process, its imports
    and the CUDA context made first (the parent warms the page cache or drops it): seconds to the
    last tensor there. instanttensor: safe_open(device=N), its tensors owned; runai-model-streamer:
    SafetensorsStreamer.stream_file(device=...); fastsafetensors: SafeTensorsFileLoader(nogds=True)
    and copy_files_to_device(). A loader that cannot be imported here is reported as such."""
    import torch
    path = str(Path(folder) / "model.safetensors")
    torch.zeros(1, device=device)
    try:
        if which == "instanttensor":
            from instanttensor import safe_open
        elif which == "runai":
            from runai_model_streamer import SafetensorsStreamer
        else:
            from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    except Exception as e:  # not installed, or built for another torch
        return {"unavailable": f"{type(e).__name__}: {e}"}
    start = time.perf_counter()
    if which == "instanttensor":
        with safe_open(path, framework="pt", device=torch.device(device).index or 0) as f:
            tensors = dict(f.tensors())
    elif which == "runai":
        tensors = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path, device=device)
            for name, tensor in streamer.get_tensors():
                tensors[name] = tensor.clone()  # its buffer is reused for the next ones
    else:
        loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
        loader.add_filenames({0: [path]})
        buffer = loader.copy_files_to_device()
        tensors = {name: buffer.get_tensor(name) for name in buffer.key_to_rank_lidx}
    synchronize(device)
    seconds = time.perf_counter() - start
    on_device = {t.device.type for t in tensors.values()} == {torch.device(device).type}
    return {"seconds": seconds, "tensors": len(tensors), "on_device": on_device,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def fast_loaders(args, workdir, folder):
    """Each fast loader and vramd (vramctl run's load onto the device, all resident) to the whole
    checkpoint on the device, from the page cache (read just before) and cold (dropped just
    before), in turn."""
    path = folder / "model.safetensors"
    resident = f'computation = {{ device = "{args.device}" }}\n'
    figures = {}
    for kind in ("warm", "cold"):
        for which in (*FAST_LOADERS, "vramd"):
            if kind == "warm":
                subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
            else:
                drop_page_cache(path)
            try:
                if which == "vramd":
                    stats = vramctl_run(workdir, folder, f"ready-{kind}", resident, args)
                    figures[f"vramd_{kind}"] = {"seconds": stats["plan_seconds"] + stats["load_seconds"]}
                else:
                    figures[f"{which}_{kind}"] = contender(f"fast-{which}", args, folder)
            except Exception as e:  # one loader's failure is reported beside the others' figures
                figures[f"{which}_{kind}"] = {"error": str(e)}
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm again for the others
    return figures


CONTENDERS = {
    "lease": lambda a: state_dict_contender(a.folder, a.device, a.socket),
    "load-file": lambda a: state_dict_contender(a.folder, a.device, ""),
    "accelerate-cpu": lambda a: accelerate_contender(a.folder, a.device, "cpu", a.tokens, a.forwards, a.offload_dir),
    "accelerate-disk": lambda a: accelerate_contender(a.folder, a.device, "disk", a.tokens, a.forwards, a.offload_dir),
    "diffsynth-cpu": lambda a: diffsynth_contender(a.folder, a.device, "cpu", a.tokens, a.forwards, a.limit),
    "diffsynth-disk": lambda a: diffsynth_contender(a.folder, a.device, "disk", a.tokens, a.forwards, a.limit),
    "transformers-ready": lambda a: transformers_ready_contender(a.folder, a.device),
    "copy-bound": lambda a: copy_bound_contender(a.folder, a.device),
    **{f"fast-{which}": (lambda a, which=which: fast_loader_contender(which, a.folder, a.device)) for which in FAST_LOADERS},
}


def contender(name, args, folder, offload_dir="", sock="", limit=0):
    out = subprocess.run([sys.executable, __file__, "--contender", name, "--folder", str(folder), "--device", args.device,
                          "--tokens", str(args.tokens), "--forwards", str(args.forwards), "--offload-dir", offload_dir,
                          "--socket", str(sock), "--limit", str(limit)],
                         capture_output=True, text=True, timeout=time_left())
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# vramd's side, through vramctl run and the daemon.

BUDGETS = '[budgets]\ncpu = "64GiB"\n"cuda:0" = "64GiB"\n'  # a [vram].limit needs its device's budget


def vramctl_run(workdir, folder, name, vram, args):
    config = workdir / f"{name}.toml"
    config.write_text(f'checkpoint = "{folder}"\ndtype = "bfloat16"\n[vram]\n{vram}')
    (workdir / "vramd.toml").write_text(BUDGETS)
    stats = workdir / f"{name}-stats.json"
    stats.unlink(missing_ok=True)  # never an earlier run's
    out = subprocess.run([VRAMCTL, "run", config, "--daemon-config", workdir / "vramd.toml", "-i", workdir / "inputs.safetensors",
                          "--repeat", str(args.forwards), "--stats-json", stats],
                         capture_output=True, text=True, timeout=time_left())
    if out.returncode < 0 and stats.exists():
        # Killed by a signal after it wrote its figures (an abort at exit, as on the first GPU
        # machine lent): a failure all the same, with the figures kept beside the error.
        return {**json.loads(stats.read_text()),
                "error": f"{out.stderr[-4000:]}\nvramctl run {name} died of signal {-out.returncode} after writing its "
                         "figures (kept in figures.json)"}
    if out.returncode != 0:
        raise RuntimeError(f"vramctl run {name} failed:\n{out.stderr[-4000:]}")
    return json.loads(stats.read_text())


def drop_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def read_bound_bytes_per_second(path):
    """The disk's speed on the checkpoint as bench/stream.py measures it without fio: 16 O_DIRECT
    reads of 8 MiB in flight for 3 s, into huge pages and into 4 KiB pages, the better. Where
    the file system refuses O_DIRECT, a cold buffered read."""
    try:
        return stream_bench.read_bound([path], 3)[0]
    except OSError:
        return cold_read_bytes_per_second(path)


def staged_reads(path, device):
    """vramd's staged reads (16 O_DIRECT reads of 8 MiB in flight, vramd_bench_storage), page cache
    dropped before each: alone, nothing copied out, into memory of 4 KiB pages and of huge pages
    (on a virtual disk the first can be a fraction of the second); and on a GPU the whole way
    onto the device through DeviceStaging's buffers, huge pages registered with the driver
    against LibTorch's pinned memory (4 KiB pages). GB/s each."""
    modes = {"pages": "staged-pages", "huge": "staged-huge"}
    if device.startswith("cuda"):
        modes.update({"device_registered": "staged-cuda", "device_pinned": "staged-cuda-pinned"})
    figures = {}
    for name, mode in modes.items():
        drop_page_cache(path)
        out = subprocess.run([VRAMCTL.parent / "vramd_bench_storage", "read", path, "1", mode],
                             capture_output=True, text=True, check=True, timeout=time_left())
        stats = json.loads(out.stdout)
        figures[name] = stats["bytes"] / stats["seconds"][0]
        if "host_memory" in stats:
            figures[name + "_memory"] = stats["host_memory"]
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm again for the others
    return figures


def cold_read_bytes_per_second(path):
    drop_page_cache(path)
    start = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            total += len(chunk)
    seconds = time.perf_counter() - start
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm again for the others
    return total / seconds


def through_daemon(workdir, folder, args):
    """Through the daemon: load on the device; a fresh process's state dict from a lease against
    one from load_file; then offload and onload, seconds per GiB each way."""
    device = args.device
    folder_d = workdir / "daemon"
    (folder_d / "models").mkdir(parents=True, exist_ok=True)
    sock_dir = Path(tempfile.mkdtemp(prefix="vramd-gpu-"))  # short: a socket's path has 107 bytes at most
    sock = sock_dir / "vramd.sock"
    (folder_d / "vramd.toml").write_text(f'socket = "{sock}"\nmodels = "models"\nlog_level = "warn"\n{BUDGETS}')
    offload = "cpu" if device.startswith("cuda") else "disk"
    (folder_d / "models" / "bench.toml").write_text(
        f'checkpoint = "{folder}"\ndtype = "bfloat16"\n[vram]\ncomputation = {{ device = "{device}" }}\n'
        f'offload = {{ device = "{offload}" }}\n')
    daemon = subprocess.Popen([VRAMD, "--config", folder_d / "vramd.toml"], stderr=subprocess.PIPE, text=True)
    try:
        import vram  # bench/vram.py
        with vram.answering(daemon, sock, lambda: daemon.stderr.read()) as client:
            client.load("bench")
            figures = {"lease": contender("lease", args, folder, sock=sock),
                       "load_file": contender("load-file", args, folder)}
            sleeps, wakes = [], []
            for _ in range(3):
                moved = client.offload("bench")["moved"]
                sleeps.append(moved["seconds"] / (moved["bytes"] / GIB) if moved["bytes"] else None)
                moved = client.onload("bench")["moved"]
                wakes.append(moved["seconds"] / (moved["bytes"] / GIB) if moved["bytes"] else None)
        figures["sleep_wake"] = {"offload_to": offload, "sleep_seconds_per_gib": min(s for s in sleeps if s is not None),
                                 "wake_seconds_per_gib": min(w for w in wakes if w is not None)}
        return figures
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        shutil.rmtree(sock_dir, ignore_errors=True)


def streamed_config(device, onload, limit, onload_dtype=None, direct_io=None):
    dtype = f', dtype = "{onload_dtype}"' if onload_dtype else ""
    direct = f"direct_io = {str(direct_io).lower()}\n" if direct_io is not None else ""
    return (f'computation = {{ device = "{device}" }}\noffload = {{ device = "{onload}" }}\n'
            f'onload = {{ device = "{onload}"{dtype} }}\nlimit = {limit}\n{direct}')


def disk_path(stats):
    """Which path a streamed model's reads from disk took and why, as its plan says."""
    plan = stats["vram"].get("plan", "")
    start = plan.find("streamed from disk (")
    if start < 0 or ";" not in plan[start:]:
        return "its plan does not say"
    depth, begin = 0, plan.index(";", start) + 2
    for at in range(start + len("streamed from disk "), len(plan)):  # to the parenthesis that closes it
        depth += {"(": 1, ")": -1}.get(plan[at], 0)
        if depth == 0:
            return plan[begin:at]
    return plan[begin:]


def staging_rate(stats):
    v = stats["vram"]
    return v["bytes_streamed"] / v["read_seconds"] if v["read_seconds"] else None


def run(args):
    import torch
    from safetensors.torch import load_file, save_file
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    folder = workdir / ("llama1b" if args.size == "1b" else "llama-small")
    shape = load_bench.SHAPE if args.size == "1b" else SMALL
    size = load_bench.warm_checkpoint(folder, shape)
    save_file({"input_ids": (torch.arange(args.tokens).view(1, args.tokens) % shape["vocab_size"]).contiguous()},
              workdir / "inputs.safetensors")
    largest = max(t.numel() * t.element_size() for t in load_file(folder / "model.safetensors").values())
    limit = max(size // 4, largest * 5 // 4)
    gpu = args.device.startswith("cuda")
    results = {"device": args.device, "size": args.size, "checkpoint_bytes": size, "limit": limit,
               "tokens": args.tokens, "forwards": args.forwards, "skipped": {}}
    if gpu:
        results["gpu"] = torch.cuda.get_device_name(args.device)
    skip = results["skipped"]

    def step(name, body):
        assert name in STEPS, name
        if args.only and name not in args.only:
            return
        print(f"gpu bench: {name}", file=sys.stderr, flush=True)
        if DEADLINE is not None and time.time() >= DEADLINE:
            skip[name] = OUT_OF_TIME
            return
        try:
            results[name] = body()
        except Exception as e:  # one failed step is reported and the others still run
            results[name] = {"error": str(e)}

    step("resident", lambda: vramctl_run(workdir, folder, "resident", f'computation = {{ device = "{args.device}" }}\n', args))
    step("vramd_disk", lambda: vramctl_run(workdir, folder, "streamed-disk", streamed_config(args.device, "disk", limit), args))
    step("vramd_disk_direct", lambda: vramctl_run(workdir, folder, "streamed-disk-direct",
                                                  streamed_config(args.device, "disk", limit, direct_io=True), args))
    step("vramd_disk_buffered", lambda: vramctl_run(workdir, folder, "streamed-disk-buffered",
                                                    streamed_config(args.device, "disk", limit, direct_io=False), args))
    step("accelerate_disk", lambda: contender("accelerate-disk", args, folder, str(workdir / "accelerate-offload")))
    step("diffsynth_disk", lambda: contender("diffsynth-disk", args, folder, limit=limit))
    step("read_bound_bytes_per_second", lambda: read_bound_bytes_per_second(folder / "model.safetensors"))
    step("staged_reads", lambda: staged_reads(folder / "model.safetensors", args.device))
    step("transformers_ready", lambda: contender("transformers-ready", args, folder))
    step("daemon", lambda: through_daemon(workdir, folder, args))
    if isinstance(results.get("daemon"), dict) and "error" not in results["daemon"]:
        results.update(results.pop("daemon"))
    if gpu:
        step("vramd_host", lambda: vramctl_run(workdir, folder, "streamed-host", streamed_config(args.device, "cpu", limit), args))
        step("vramd_host_float8", lambda: vramctl_run(workdir, folder, "streamed-host-fp8",
                                                      streamed_config(args.device, "cpu", limit, "float8_e4m3fn"), args))
        step("accelerate_cpu", lambda: contender("accelerate-cpu", args, folder))
        step("diffsynth_host", lambda: contender("diffsynth-cpu", args, folder, limit=limit))
        step("copy_bound", lambda: contender("copy-bound", args, folder))
        step("fast_loaders", lambda: fast_loaders(args, workdir, folder))
    else:
        for name, why in (("vramd_host", "streaming from host memory to a GPU"),
                          ("vramd_host_float8", "float8 onload computed in bfloat16 on a GPU"),
                          ("accelerate_cpu", "accelerate's CPU offload computes on a GPU"),
                          ("copy_bound", "the pinned host-to-GPU copy bound"),
                          ("diffsynth_host", "DiffSynth-Studio's host offload computes on a GPU"),
                          ("fast_loaders", "instanttensor, runai-model-streamer and fastsafetensors to a GPU")):
            if not args.only or name in args.only:
                skip[name] = "no CUDA device: " + why
    results["summary"] = summarise(results)
    return results


# What run() measures, in its order: --only picks from these.
STEPS = ("resident", "vramd_disk", "vramd_disk_direct", "vramd_disk_buffered", "accelerate_disk", "diffsynth_disk",
         "read_bound_bytes_per_second", "staged_reads", "transformers_ready", "daemon", "vramd_host",
         "vramd_host_float8", "accelerate_cpu", "diffsynth_host", "copy_bound", "fast_loaders")


def ok(results, *names):
    return all(isinstance(results.get(n), (dict, float, int)) and not (isinstance(results[n], dict) and "error" in results[n])
               for n in names)


def shrank(grown):
    """How the device's free memory changed, from the bytes a process grew it by."""
    return f"shrank by {grown / 2**20:.1f} MiB" if grown >= 0 else f"grew by {-grown / 2**20:.1f} MiB"


def fast_loader_lines(r):
    """Time to the whole checkpoint on the device, vramd against each fast loader, from the page
    cache against the pinned copy's bound and cold against the disk's read bound."""
    lines, f = [], r["fast_loaders"]
    bounds = {"warm": ("the pinned copy's", r.get("copy_bound", {}).get("bytes_per_second") if ok(r, "copy_bound") else None),
              "cold": ("the disk's read", r.get("read_bound_bytes_per_second") if ok(r, "read_bound_bytes_per_second") else None)}
    for kind, (bound_name, bound) in bounds.items():
        ours = f.get(f"vramd_{kind}", {})
        if "seconds" not in ours:
            lines.append(f"FAILED fast loaders, vramd {kind}: {(ours.get('error') or '?').strip().splitlines()[-1]}")
            continue
        rate = r["checkpoint_bytes"] / ours["seconds"]
        parts, fastest = [], None
        for which in FAST_LOADERS:
            theirs = f.get(f"{which}_{kind}", {})
            if "seconds" in theirs:
                parts.append(f"{which} {theirs['seconds']:.3f} s ({theirs['seconds'] / ours['seconds']:.2f}x"
                             f"{'' if theirs.get('on_device') else ', NOT all on the device'})")
                fastest = min(fastest or theirs["seconds"], theirs["seconds"])
            else:
                why = theirs.get("unavailable") or (theirs.get("error") or "?").strip().splitlines()[-1]
                parts.append(f"{which} not run ({why})")
        against = f", {rate / bound:.0%} of {bound_name} bound ({bound / 1e9:.2f} GB/s)" if bound else ""
        versus = f"; vramd {fastest / ours['seconds']:.2f}x the fastest" if fastest else ""
        lines.append(f"ready on {r['device']} ({'page cache' if kind == 'warm' else 'cold'}): vramd {ours['seconds']:.3f} s "
                     f"({rate / 1e9:.2f} GB/s{against}), {', '.join(parts)}{versus}")
    return lines


def summarise(r):
    """One line per comparison: what was measured against what, and the ratio."""
    lines = []
    fwd = lambda name: r[name]["forward_median_seconds"]  # noqa: E731
    def peers(ours, *names):  # "accelerate 0.468 s (4.21x), DiffSynth ..." for each peer that ran
        return ", ".join(f"{label} {fwd(name):.3f} s ({fwd(name) / fwd(ours):.2f}x)"
                         for label, name in zip(("accelerate", "DiffSynth"), names) if ok(r, name))

    if ok(r, "vramd_disk") and (ok(r, "accelerate_disk") or ok(r, "diffsynth_disk")):
        lines.append(f"streaming from disk: vramd {fwd('vramd_disk'):.3f} s a forward, "
                     f"{peers('vramd_disk', 'accelerate_disk', 'diffsynth_disk')}; vramd's peak "
                     f"{r['vramd_disk']['vram']['peak']} of its {r['limit']} byte limit")
    if ok(r, "vramd_host") and (ok(r, "accelerate_cpu") or ok(r, "diffsynth_host")):
        lines.append(f"streaming from host: vramd {fwd('vramd_host'):.3f} s a forward, "
                     f"{peers('vramd_host', 'accelerate_cpu', 'diffsynth_host')}; vramd's peak "
                     f"{r['vramd_host']['vram']['peak']} of its {r['limit']} byte limit, the CUDA allocator's peak "
                     f"{r['vramd_host'].get('device_peak_allocated')}")
    if ok(r, "vramd_host", "copy_bound") and staging_rate(r["vramd_host"]):
        rate, bound = staging_rate(r["vramd_host"]), r["copy_bound"]["bytes_per_second"]
        lines.append(f"host-to-GPU staging: {rate / 1e9:.2f} GB/s against a pinned copy's {bound / 1e9:.2f} GB/s "
                     f"({rate / bound:.0%})")
    if ok(r, "vramd_disk_direct", "read_bound_bytes_per_second") and staging_rate(r["vramd_disk_direct"]):
        rate, bound = staging_rate(r["vramd_disk_direct"]), r["read_bound_bytes_per_second"]
        lines.append(f"disk-to-device onload (direct_io): {rate / 1e9:.2f} GB/s against the disk's read bound, "
                     f"{bound / 1e9:.2f} GB/s ({rate / bound:.0%}); forward {fwd('vramd_disk_direct'):.3f} s")
    if ok(r, "vramd_disk_direct", "resident", "read_bound_bytes_per_second"):
        # #26: a forward streamed from disk within 1.1x of the larger of the time its reads need
        # at the disk's bound and the time it computes (the same forward with every layer resident).
        streamed = r["vramd_disk_direct"]["vram"]["bytes_streamed"] / r["vramd_disk_direct"]["forwards"]
        reads, compute = streamed / r["read_bound_bytes_per_second"], fwd("resident")
        lines.append(f"forward streamed from disk (direct_io): {fwd('vramd_disk_direct'):.3f} s against the bound's "
                     f"{reads:.3f} s for its {streamed / GIB:.2f} GiB and {compute:.3f} s resident: "
                     f"{fwd('vramd_disk_direct') / max(reads, compute):.2f}x the larger")
    if ok(r, "vramd_disk", "vramd_disk_direct", "vramd_disk_buffered"):
        auto, true, false = fwd("vramd_disk"), fwd("vramd_disk_direct"), fwd("vramd_disk_buffered")
        lines.append(f"direct_io from disk: auto {auto:.3f} s a forward ({disk_path(r['vramd_disk'])}), true {true:.3f} s, "
                     f"false {false:.3f} s: auto {auto / min(true, false):.2f}x the better")
    if ok(r, "staged_reads", "read_bound_bytes_per_second"):
        pages, huge, bound = r["staged_reads"]["pages"], r["staged_reads"]["huge"], r["read_bound_bytes_per_second"]
        lines.append(f"staged reads alone (16 of 8 MiB in flight, O_DIRECT): {pages / 1e9:.2f} GB/s into 4 KiB pages, "
                     f"{huge / 1e9:.2f} GB/s into huge pages, against the bound's {bound / 1e9:.2f} GB/s")
        if "device_registered" in r["staged_reads"]:
            staged = r["staged_reads"]
            lines.append(f"staged reads onto the device: {staged['device_registered'] / 1e9:.2f} GB/s through "
                         f"{staged['device_registered_memory']}, {staged['device_pinned'] / 1e9:.2f} GB/s through "
                         f"{staged['device_pinned_memory']}")
    if ok(r, "resident", "transformers_ready"):
        ours = r["resident"]["plan_seconds"] + r["resident"]["load_seconds"]
        theirs = r["transformers_ready"]["ready_seconds"]
        lines.append(f"ready on {r['device']}: vramd {ours:.3f} s, from_pretrained {theirs:.3f} s ({theirs / ours:.2f}x)")
    if ok(r, "vramd_host", "vramd_host_float8"):
        a, b = r["vramd_host"], r["vramd_host_float8"]
        moved, plain = b["vram"]["bytes_moved"], a["vram"]["bytes_moved"]
        lines.append(f"float8 onload: {moved} bytes moved to the device against {plain} in bfloat16 "
                     f"({moved / plain:.2f}x), forward {fwd('vramd_host_float8'):.3f} s against "
                     f"{fwd('vramd_host'):.3f} s")
    if ok(r, "lease", "load_file"):
        a, b = r["lease"], r["load_file"]
        memory = (f"; the device's free memory {shrank(a['device_bytes_grown'])} for the lease, "
                  f"{shrank(b['device_bytes_grown'])} for load_file" if r["device"].startswith("cuda") else "")
        lines.append(f"a state dict on {r['device']} in a fresh process: lease {a['seconds']:.4f} s, load_file "
                     f"{b['seconds']:.4f} s ({b['seconds'] / a['seconds']:.1f}x), of a {a['bytes'] / 2**20:.1f} MiB "
                     f"model{memory}")
    if ok(r, "fast_loaders"):
        lines += fast_loader_lines(r)
    if ok(r, "sleep_wake"):
        s = r["sleep_wake"]
        lines.append(f"sleep/wake (offload to {s['offload_to']}): {s['sleep_seconds_per_gib']:.4f} s/GiB to sleep, "
                     f"{s['wake_seconds_per_gib']:.4f} s/GiB to wake")
    for name, value in r.items():
        if isinstance(value, dict) and "error" in value:
            lines.append(f"FAILED {name}: {value['error'].strip().splitlines()[-1] if value['error'].strip() else '?'}")
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--size", choices=["1b", "small"], default="1b")
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--forwards", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--offload-dir", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help="time.time() by which every step must be done")
    parser.add_argument("--only", type=lambda text: text.split(","), help="those steps alone, comma separated")
    args = parser.parse_args()
    if unknown := set(args.only or ()) - set(STEPS):
        parser.error(f"--only names no step: {', '.join(sorted(unknown))} (steps: {', '.join(STEPS)})")
    global DEADLINE
    DEADLINE = args.deadline
    if args.contender:
        print(json.dumps(CONTENDERS[args.contender](args)))
        return
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    for line in results["summary"]:
        print(line)
    for name, why in results["skipped"].items():
        print(f"skipped {name}: {why}")
    failed = [n for n, v in results.items() if isinstance(v, dict) and "error" in v]
    sys.exit(1 if failed or OUT_OF_TIME in results["skipped"].values() else 0)


if __name__ == "__main__":
    main()
