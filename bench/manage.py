"""Managed modules: one diffusers UNet2DConditionModel whose weights rest in bfloat16 in host memory,
computed on DEVICE under a limit of a quarter of its size, three ways in the same run, each in a
fresh process:

    vramd        vramd.manage: the daemon holds the weights once (architecture "weights" with a
                 [vram] table); the process builds the module on the meta device and leases them
    vramd-lean   the same under a limit of twice the largest unit's bytes: about what the peers
                 hold at once (one module's weights), where vramd otherwise fills its limit with
                 units that stay (one process; its host memory is vramd's)
    vramd-gguf   vramd under the same limit from a GGUF file of the same weights, each 2-D one
                 quantized (--gguf, Q8_0 by default) and resting packed: its blocks cross to
                 DEVICE as they are and are unpacked there (its outputs are the quantized model's;
                 one process)
    accelerate   accelerate.cpu_offload: the process loads the checkpoint into host memory, and
                 every module's weights move to DEVICE for each call (diffusers' sequential offload)
    diffsynth    DiffSynth-Studio's enable_vram_management: every Linear, Conv2d, GroupNorm and
                 LayerNorm wrapped, offload and onload in host memory, vram_limit the same limit

For each: the median forward (of those after the first), the peak memory (on a GPU the CUDA
allocator's peak over the forwards; on the CPU the anonymous memory the process grew by, with
glibc's mmap threshold fixed so that freed blocks go back), the time from the process's start to
its first output (and from the end of the imports of torch and diffusers, which every contender
pays alike; and where it went: the CUDA context, the module made ready, the first forward), and
the host memory of three such processes at once (the sum of their PSS).
On the CPU accelerate's and DiffSynth's offloads have nowhere to move weights to: their figures
are their whole-model runs, vramd's the managed one.

    .venv/bin/python bench/manage.py [--device cuda:0] [--unet small|sd15] [--workdir /tmp/vramd-bench] [--forwards 5]
                                     [--contenders vramd,accelerate,diffsynth] [--processes 3] [--gguf Q8_0]
                                     [--json FILE]

See docs/benchmarks.md.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "python"))

VRAMD = ROOT / "build" / "bin" / "vramd"
STARTED = time.perf_counter()  # the process's start, as near as Python sees it
# --unet: the small UNet (136 MiB in bfloat16), or Stable Diffusion 1.5's shape (1.6 GiB), where
# reading and casting the weights is what a new process pays.
UNETS = {
    "small": dict(sample_size=32, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512),
                  down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=256,
                  attention_head_dim=8, norm_num_groups=32),
    "sd15": dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=768,
                 attention_head_dim=8, norm_num_groups=32),
}


def memory():
    """(anonymous bytes, PSS bytes) of this process."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in ("Anonymous:", "Pss:"):
                fields[parts[0]] = int(parts[1]) * 1024
    return fields["Anonymous:"], fields["Pss:"]


def inputs(device, dtype, config):
    import torch
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 32, 32, generator=g).to(device, dtype)
    states = torch.randn(1, 8, config["cross_attention_dim"], generator=g).to(device, dtype)
    return sample, states


def write_gguf(source, path, kind):
    """The checkpoint `source` as a GGUF file at `path`: each 2-D weight whose rows are whole blocks
    quantized to `kind` by the gguf package, the rest in float32, under the same names."""
    import gguf
    from safetensors.torch import load_file
    qtype = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = gguf.GGUFWriter(path, "unet")
    for name, tensor in load_file(str(source)).items():
        array = tensor.float().numpy()
        if array.ndim == 2 and array.shape[-1] % block == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def contender(kind, folder, config, device, forwards, limit, hold, lean_limit):
    """Runs in its own process: set up, first output, timed forwards."""
    import torch
    import diffusers
    diffusers.UNet2DConditionModel  # noqa: B018 - diffusers imports its classes on first use: part of the imports
    imported = time.perf_counter()
    gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu:
        torch.zeros(1, device=device)  # the CUDA context, before what is measured
    context = time.perf_counter()
    anonymous, _ = memory()
    sample, states = inputs(device, dtype, config)
    if kind.startswith("vramd"):
        import vramd
        with torch.device("meta"):  # no buffers made in __init__: nothing to keep real
            model = diffusers.UNet2DConditionModel(**config).eval()
        managed = vramd.manage(model, "unet-gguf" if kind == "vramd-gguf" else "unet", device=device, dtype=dtype,
                               limit=lean_limit if kind == "vramd-lean" else None)
    else:
        from safetensors.torch import load_file
        model = diffusers.UNet2DConditionModel(**config).eval()
        model.load_state_dict(load_file(str(folder / "diffusion_pytorch_model.safetensors")))
        model.to(torch.bfloat16)  # at rest in host memory in bfloat16, as vramd's
        if kind == "accelerate":
            from accelerate import cpu_offload
            if gpu:
                cpu_offload(model, execution_device=torch.device(device))
            else:
                model.to(dtype)
        else:
            import vram  # bench/vram.py: DiffSynth's VRAM modules without the rest of the package
            layers = vram.import_diffsynth_vram()
            if layers is None:
                raise RuntimeError(vram.DIFFSYNTH_MISSING)
            config = {"offload_dtype": torch.bfloat16, "offload_device": "cpu", "onload_dtype": torch.bfloat16,
                      "onload_device": "cpu", "preparing_dtype": dtype, "preparing_device": device,
                      "computation_dtype": dtype, "computation_device": device}
            vram_limit = None
            if gpu:
                free, total = torch.cuda.mem_get_info(device)
                vram_limit = (total - free + limit) / (1 << 30)
            module_map = {torch.nn.Linear: layers.AutoWrappedLinear, torch.nn.Conv2d: layers.AutoWrappedModule,
                          torch.nn.GroupNorm: layers.AutoWrappedModule, torch.nn.LayerNorm: layers.AutoWrappedModule}
            model = layers.enable_vram_management(model, module_map, config, vram_limit=vram_limit)
            if gpu:
                for module in model.modules():
                    if isinstance(module, layers.AutoTorchModule):
                        module.onload()
    ready = time.perf_counter()
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    with torch.inference_mode():
        for i in range(forwards):
            if gpu:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(sample, 10, states)
            if gpu:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            if i == 0:
                first_output, after_imports = time.perf_counter() - STARTED, time.perf_counter() - imported
    grown, pss = memory()
    figures = {"forward_median_seconds": statistics.median(times[1:] or times), "first_output_seconds": first_output,
               "after_imports_seconds": after_imports,
               # where the time after the imports went: the CUDA context, building and filling the
               # module (vramd: on the meta device, then manage(); the peers: on the CPU, loading
               # and offloading), the first forward
               "phases": {"context": context - imported, "ready": ready - context, "first_forward": times[0]},
               "peak": torch.cuda.max_memory_allocated(device) if gpu else grown - anonymous, "pss": pss}
    if kind.startswith("vramd"):
        figures["managed"] = managed.stats()
    print(json.dumps(figures), flush=True)
    if hold:
        sys.stdin.readline()


def run(args, kind, hold=False):
    command = [sys.executable, __file__, "--workdir", args.workdir, "--unet", args.unet, "--device", args.device, "--forwards",
               str(args.forwards), "--limit", str(args.limit), "--lean-limit", str(args.lean_limit), "--contender",
               kind] + (["--hold"] if hold else [])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def one(args, kind):
    process = run(args, kind)
    out, _ = process.communicate(timeout=1800)
    if process.returncode != 0:
        raise RuntimeError(f"{kind} failed ({process.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def held_together(args, kind):
    """The sum of PROCESSES holding processes' PSS."""
    processes = [run(args, kind, hold=True) for _ in range(args.processes)]
    try:
        return sum(json.loads(p.stdout.readline())["pss"] for p in processes)
    finally:
        for p in processes:
            p.communicate("\n", timeout=600)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--forwards", type=int, default=5)
    parser.add_argument("--unet", choices=sorted(UNETS), default="small", help="the model's shape (default: small)")
    parser.add_argument("--gguf", default="Q8_0", help="vramd-gguf's block type: Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0")
    parser.add_argument("--contenders", default="vramd,vramd-lean,vramd-gguf,accelerate,diffsynth",
                        help="which to run, comma-separated (default: all)")
    parser.add_argument("--processes", type=int, default=3, help="processes holding the model at once for the PSS")
    parser.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lean-limit", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    folder = Path(args.workdir) / ("unet" if args.unet == "small" else f"unet-{args.unet}")
    config = UNETS[args.unet]
    if args.contender:
        contender(args.contender, folder, config, args.device, args.forwards, args.limit, args.hold, args.lean_limit)
        return

    import torch
    import diffusers
    if not (folder / "diffusion_pytorch_model.safetensors").exists():
        torch.manual_seed(0)
        diffusers.UNet2DConditionModel(**config).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    contenders = args.contenders.split(",")
    served = {"unet": folder}  # the daemon's models: their checkpoints
    if "vramd-gguf" in contenders:
        served["unet-gguf"] = folder / f"unet-{args.gguf.lower()}.gguf"
        if not served["unet-gguf"].exists():
            write_gguf(folder / "diffusion_pytorch_model.safetensors", served["unet-gguf"], args.gguf)
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**config)
    size = sum(p.numel() for p in unet.parameters())
    element = 2 if args.device.startswith("cuda") else 4
    args.limit = size * element // 4
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in unet.modules()) * element
    args.lean_limit = 2 * largest
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "models").mkdir()
        compute = "bfloat16" if args.device.startswith("cuda") else "float32"
        for name, checkpoint in served.items():  # GGUF blocks packed: "auto" under a limit
            (tmp / "models" / f"{name}.toml").write_text(
                f'checkpoint = "{checkpoint}"\narchitecture = "weights"\ndtype = "{compute}"\n[vram]\n'
                f'computation = {{ device = "{args.device}" }}\nonload = {{ device = "cpu", dtype = "bfloat16" }}\n'
                f'limit = {args.limit}\n')
        sock = tmp / "vramd.sock"
        budget = f'"{args.device}" = "{max(4 * args.limit, 1 << 30)}"\n' if args.device != "cpu" else ""
        (tmp / "vramd.toml").write_text(f'socket = "{sock}"\nmodels = "models"\n[budgets]\ncpu = "16GiB"\n{budget}')
        os.environ["VRAMD_SOCKET"] = str(sock)
        daemon = subprocess.Popen([VRAMD, "--config", tmp / "vramd.toml"], stderr=subprocess.DEVNULL)
        try:
            import vramd
            deadline = time.monotonic() + 120
            while True:
                try:
                    with vramd.connect(sock) as client:
                        for name in served:
                            client.load(name)
                    break
                except (vramd.DaemonUnreachable, vramd.DaemonError):
                    assert time.monotonic() < deadline and daemon.poll() is None, "vramd did not start"
                    time.sleep(0.2)
            for kind in contenders:
                try:
                    results[kind] = one(args, kind)
                    if kind not in ("vramd-lean", "vramd-gguf"):  # their host memory is vramd's
                        results[kind]["pss_processes"] = held_together(args, kind)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run is said, the others go on
                    results[kind] = {"error": str(e)}
        finally:
            daemon.terminate()
            daemon.wait(60)

    mib = 1 << 20
    print(f"UNet2DConditionModel ({args.unet}), {size * 2 / mib:.1f} MiB at rest in bfloat16, computed in {compute} on {args.device} "
          f"under a limit of {args.limit / mib:.1f} MiB (a quarter; vramd-lean {args.lean_limit / mib:.1f} MiB, twice the "
          f"largest unit), {args.forwards} forwards, {os.cpu_count()} cores")
    for kind, r in results.items():
        if "error" in r:
            print(f"  {kind:11s} failed: {r['error']}")
            continue
        print(f"  {kind:11s} forward {r['forward_median_seconds']:.3f} s, peak {r['peak'] / mib:7.1f} MiB, first output "
              f"{r['first_output_seconds']:.2f} s from the process's start ({r['after_imports_seconds']:.2f} s after "
              f"torch and diffusers are imported: context {r['phases']['context']:.2f} s, module ready "
              f"{r['phases']['ready']:.2f} s, first forward {r['phases']['first_forward']:.2f} s)"
              + (f", {args.processes} processes' PSS {r['pss_processes'] / mib:.1f} MiB" if "pss_processes" in r else ""))
    v, lean = results.get("vramd", {}), results.get("vramd-lean", {})
    for kind in ("accelerate", "diffsynth"):
        r = results.get(kind, {})
        if "error" in r or not r:
            continue
        if v and "error" not in v:
            print(f"vramd against {kind}: forward {r['forward_median_seconds'] / v['forward_median_seconds']:.2f}x faster, "
                  f"peak {v['peak'] / r['peak']:.2f}x, first output "
                  f"{r['first_output_seconds'] / v['first_output_seconds']:.1f}x sooner "
                  f"({r['after_imports_seconds'] / v['after_imports_seconds']:.1f}x after the imports), "
                  f"{args.processes} processes' PSS {v['pss_processes'] / r['pss_processes']:.2f}x")
        if lean and "error" not in lean:
            print(f"vramd-lean against {kind}: forward {r['forward_median_seconds'] / lean['forward_median_seconds']:.2f}x "
                  f"faster, peak {lean['peak'] / r['peak']:.2f}x")
    g = results.get("vramd-gguf", {})
    if v and g and "error" not in v and "error" not in g:
        print(f"vramd-gguf ({args.gguf} blocks packed) against vramd (bfloat16): forward "
              f"{v['forward_median_seconds'] / g['forward_median_seconds']:.2f}x faster, bytes read from host memory "
              f"{g['managed']['bytes_read'] / v['managed']['bytes_read']:.2f}x, peak {g['peak'] / v['peak']:.2f}x")
    for kind, r in ((kind, results.get(kind, {})) for kind in ("vramd", "vramd-lean", "vramd-gguf")):
        if "managed" in r:
            m = r["managed"]
            print(f"{kind}'s manager: peak {m['peak']} of its {m['limit']}-byte limit, {m['loads']} unit loads, "
                  f"{m['bytes_read'] / mib:.1f} MiB read from host memory, {m['prefetch_hits']} prefetched in time")
    if args.json:
        Path(args.json).write_text(json.dumps({"size_bytes": size * 2, "limit": args.limit, "lean_limit": args.lean_limit,
                                               "device": args.device, "gguf": args.gguf,
                                               "processes": args.processes,
                                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
