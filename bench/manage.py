"""Managed modules: one diffusers module (--model: a UNet2DConditionModel, or a diffusion
transformer, SD3Transformer2DModel) whose weights rest in bfloat16 in host memory, computed on DEVICE
under a limit of a quarter of its size, several ways, each in a fresh process:

    vramd        vramd.manage: the daemon holds the weights once (architecture "weights" with a
                 [vram] table); the process builds the module on the meta device and leases them
    vramd-lean   the same under a limit of twice the largest unit's bytes: about what the peers
                 hold at once (one module's weights), where vramd otherwise fills its limit with
                 units that stay (one process; its host memory is vramd's)
    vramd-sync   vramd without prefetching: on a GPU each hook copies its unit on the computing
                 stream, so against vramd it prices the side stream (its events and stream
                 switches) on a real model (one process)
    vramd-gguf   vramd under the same limit from a GGUF file of the same weights, each 2-D one
                 quantized (--gguf, Q8_0 by default) and resting packed: its blocks cross to
                 DEVICE as they are and are unpacked there (its outputs are the quantized model's;
                 one process)
    accelerate   accelerate.cpu_offload: the process loads the checkpoint into host memory, and
                 every module's weights move to DEVICE for each call (diffusers' sequential offload)
    diffsynth    DiffSynth-Studio's enable_vram_management: every Linear, Conv2d, GroupNorm and
                 LayerNorm wrapped, offload and onload in host memory, vram_limit the same limit
    diffusers    diffusers' own from_pretrained and its group offload (leaf_level, use_stream):
                 one leaf module at a time on DEVICE, the next one's copy made on a side stream
    diffusers-gguf  the same from the GGUF file vramd-gguf serves (from_single_file with a
                 GGUFQuantizationConfig: blocks packed at rest, unpacked at each call): the peer of
                 vramd-gguf
    resident     no offload: the module whole on DEVICE in the computation dtype, the bound of
                 every managed forward (the others' forwards are given against its)

On a GPU an untimed process first computes one forward of the module on the device, so that
what the first contender would read from disk alone is in the page cache for all.
For each: the median forward (of those after the first), the peak memory (on a GPU the CUDA
allocator's peak over the forwards; on the CPU the anonymous memory the process grew by, with
glibc's mmap threshold fixed so that freed blocks go back), the time from the process's start to
its first output (and from the end of the imports of torch and diffusers, which every contender
pays alike; and where it went: the CUDA context, the module made ready, the first forward), and
the host memory of three such processes at once (the sum of their PSS).
Each contender's first output is compared with vramd's (from the GGUF file, vramd-gguf's), a
witness that all computed the same module from the same values.
On the CPU the peers' offloads have nowhere to move weights to: their figures are their
whole-model runs, vramd's the managed one.

    .venv/bin/python bench/manage.py [--device cuda:0] [--model unet|unet-sd15|dit] [--workdir /tmp/vramd-bench]
                                     [--forwards 5] [--contenders vramd,accelerate,diffsynth,...] [--processes 3]
                                     [--gguf Q8_0] [--json FILE]

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
# --model: diffusers' class and its config. "unet" is a small UNet (136 MiB in bfloat16, most of it
# in convolutions); "unet-sd15" Stable Diffusion 1.5's shape (1.6 GiB), where reading and casting
# the weights is what a new process pays; "dit" a small SD3-shaped diffusion transformer (141 MiB,
# nearly all of it in Linear layers: the shape of today's image and video models, and the one
# GGUF files are made for).
MODELS = {
    "unet": ("UNet2DConditionModel", dict(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=256,
        attention_head_dim=8, norm_num_groups=32)),
    "unet-sd15": ("UNet2DConditionModel", dict(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=768,
        attention_head_dim=8, norm_num_groups=32)),
    "dit": ("SD3Transformer2DModel", dict(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=8, attention_head_dim=64,
        num_attention_heads=8, joint_attention_dim=512, caption_projection_dim=512, pooled_projection_dim=256,
        pos_embed_max_size=64)),
}


PEERS = ("accelerate", "diffsynth", "diffusers")  # from the bfloat16 checkpoint, as vramd and vramd-lean


def memory():
    """(anonymous bytes, PSS bytes) of this process."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in ("Anonymous:", "Pss:"):
                fields[parts[0]] = int(parts[1]) * 1024
    return fields["Anonymous:"], fields["Pss:"]


def inputs(model, device, dtype, config):
    """The keyword arguments of one forward of MODEL: a 32x32 latent and 8 tokens of text."""
    import torch
    g = torch.Generator().manual_seed(0)
    if MODELS[model][0] == "UNet2DConditionModel":
        return {"sample": torch.randn(1, 4, 32, 32, generator=g).to(device, dtype), "timestep": 10,
                "encoder_hidden_states": torch.randn(1, 8, config["cross_attention_dim"], generator=g).to(device, dtype)}
    return {"hidden_states": torch.randn(1, config["in_channels"], 32, 32, generator=g).to(device, dtype),
            "encoder_hidden_states": torch.randn(1, 8, config["joint_attention_dim"], generator=g).to(device, dtype),
            "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=g).to(device, dtype),
            "timestep": torch.tensor([10.0], device=device)}


def write_gguf(source, path, kind):
    """The checkpoint `source` as a GGUF file at `path`: each 2-D weight whose rows are whole blocks
    quantized to `kind` by the gguf package, the rest in float32 (the checkpoint's bfloat16 values,
    which diffusers' GGUF loading takes as they are, where it would take BF16 as blocks), under the
    same names."""
    import gguf
    from safetensors.torch import load_file
    qtype = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = gguf.GGUFWriter(path, "diffusers")
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


def contender(kind, args, folder):
    """Runs in its own process: set up, first output, timed forwards."""
    import torch
    import diffusers
    # diffusers imports its classes on first use: part of the imports
    cls, config = getattr(diffusers, MODELS[args.model][0]), MODELS[args.model][1]
    diffusers.utils.logging.set_verbosity_error()  # not its advice on casting with to()
    imported = time.perf_counter()
    device = args.device
    gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu:
        torch.zeros(1, device=device)  # the CUDA context, before what is measured
    context = time.perf_counter()
    anonymous, _ = memory()
    example = inputs(args.model, device, dtype, config)
    if kind.startswith("vramd"):
        import vramd
        with torch.device("meta"):  # no buffers made in __init__: nothing to keep real
            model = cls(**config).eval()
        managed = vramd.manage(model, "model-gguf" if kind == "vramd-gguf" else "model", device=device, dtype=dtype,
                               limit=args.lean_limit if kind == "vramd-lean" else None,
                               prefetch=False if kind == "vramd-sync" else None)
    elif kind == "resident":
        model = cls.from_pretrained(folder, torch_dtype=torch.bfloat16).to(device, dtype).eval()
    elif kind.startswith("diffusers"):
        # diffusers' own loading (on the meta device, then the checkpoint's values; from the GGUF
        # file its blocks stay packed and are unpacked at each call), at rest in host memory in
        # bfloat16, and its group offload on a GPU: one leaf module at a time on the device, the
        # next one's copy made on a side stream beside the current one's computation
        if kind == "diffusers-gguf":  # a model so quantized cannot be cast: the rest made dtype here
            model = cls.from_single_file(str(gguf_file(args)), config=str(folder), torch_dtype=dtype,
                                         quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=dtype))
        else:
            model = cls.from_pretrained(folder, torch_dtype=torch.bfloat16).to(dtype)
        model.eval()
        if gpu:
            model.enable_group_offload(torch.device(device), offload_type="leaf_level", use_stream=True)
    else:
        from safetensors.torch import load_file
        model = cls(**config).eval()
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
            wrappers = {torch.nn.Linear: "AutoWrappedLinear", torch.nn.Conv2d: "AutoWrappedModule",
                        torch.nn.GroupNorm: "AutoWrappedModule", torch.nn.LayerNorm: "AutoWrappedModule"}
            model, layers = vram.diffsynth_managed(model, wrappers, device, dtype, args.limit)
            if gpu:
                for module in model.modules():
                    if isinstance(module, layers.AutoTorchModule):
                        module.onload()

                def place(module):  # what the wrappers leave (the DiT's positional table, a buffer) onto the
                    if isinstance(module, layers.AutoTorchModule):  # device, as a DiffSynth pipeline holds it
                        return
                    for tensors in (module._parameters, module._buffers):
                        for name, value in tensors.items():
                            if value is not None:
                                moved = value.detach().to(device)
                                tensors[name] = torch.nn.Parameter(moved, False) if tensors is module._parameters else moved
                    for child in module.children():
                        place(child)
                place(model)
    ready = time.perf_counter()
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    with torch.inference_mode():
        for i in range(args.forwards):
            if gpu:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            output = model(**example).sample
            if gpu:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            if i == 0:
                first_output, after_imports = time.perf_counter() - STARTED, time.perf_counter() - imported
                if not args.hold:  # for main() to compare the contenders' outputs
                    torch.save(output.float().cpu(), folder / f"output-{kind}.pt")
    grown, pss = memory()
    figures = {"forward_median_seconds": statistics.median(times[1:] or times), "forward_seconds": times[1:],
               "first_output_seconds": first_output,
               "after_imports_seconds": after_imports,
               # where the time after the imports went: the CUDA context, building and filling the
               # module (vramd: on the meta device, then manage(); the peers: loading and
               # offloading), the first forward
               "phases": {"context": context - imported, "ready": ready - context, "first_forward": times[0]},
               "peak": torch.cuda.max_memory_allocated(device) if gpu else grown - anonymous, "pss": pss}
    if kind.startswith("vramd"):
        figures["managed"] = managed.stats()
    print(json.dumps(figures), flush=True)
    if args.hold:
        sys.stdin.readline()


def warm_up(args):
    """Untimed, in a process of its own before the contenders on a GPU: one whole forward on the
    device, so that what the first contender would otherwise read from disk alone (torch's CUDA
    libraries, their kernels) is in the page cache for every contender."""
    import torch
    import diffusers
    cls, config = getattr(diffusers, MODELS[args.model][0]), MODELS[args.model][1]
    diffusers.utils.logging.set_verbosity_error()
    with torch.device(args.device):
        model = cls(**config).to(torch.bfloat16).eval()
    with torch.inference_mode():
        model(**inputs(args.model, args.device, torch.bfloat16, config))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize(args.device)


def gguf_file(args):
    """The GGUF file of --model's checkpoint, its 2-D weights quantized to --gguf."""
    return Path(args.workdir) / args.model / f"{args.model}-{args.gguf.lower()}.gguf"


def run(args, kind, hold=False):
    command = [sys.executable, __file__, "--workdir", args.workdir, "--model", args.model, "--device", args.device,
               "--forwards", str(args.forwards), "--gguf", args.gguf, "--limit", str(args.limit), "--lean-limit",
               str(args.lean_limit), "--contender", kind] + (["--hold"] if hold else [])
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
    parser.add_argument("--model", choices=list(MODELS), default="unet", help="the module (default: unet)")
    parser.add_argument("--gguf", default="Q8_0", help="the GGUF file's block type: Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0")
    # The pairs that matter most first, should a run be cut short (--json keeps those that ran):
    # vramd and the peer likely fastest on a GPU, vramd without its side stream, then both from GGUF.
    parser.add_argument("--contenders",
                        default="vramd,diffusers,vramd-sync,vramd-gguf,diffusers-gguf,accelerate,diffsynth,vramd-lean,resident",
                        help="which to run, comma-separated, in this order (default: all)")
    parser.add_argument("--processes", type=int, default=3,
                        help="processes holding the model at once for the PSS (0: none)")
    parser.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lean-limit", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    folder = Path(args.workdir) / args.model
    if args.contender == "warm-up":
        warm_up(args)
        return
    if args.contender:
        contender(args.contender, args, folder)
        return

    import torch
    import diffusers
    cls, config = getattr(diffusers, MODELS[args.model][0]), MODELS[args.model][1]
    diffusers.utils.logging.set_verbosity_error()
    if not (folder / "diffusion_pytorch_model.safetensors").exists():
        torch.manual_seed(0)
        cls(**config).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    contenders = args.contenders.split(",")
    served = {"model": folder}  # the daemon's models: their checkpoints
    if "vramd-gguf" in contenders:
        served["model-gguf"] = gguf_file(args)
    if {"vramd-gguf", "diffusers-gguf"} & set(contenders) and not gguf_file(args).exists():
        write_gguf(folder / "diffusion_pytorch_model.safetensors", gguf_file(args), args.gguf)
    with torch.device("meta"):
        module = cls(**config)
    size = sum(p.numel() for p in module.parameters())
    element = 2 if args.device.startswith("cuda") else 4
    args.limit = size * element // 4
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()) * element
    args.lean_limit = 2 * largest
    results = {}

    def save(done):  # after each contender: a run cut short keeps what it measured, and says so
        if args.json:  # whole or not at all, should the run be killed while it writes
            part = Path(args.json + ".part")
            part.write_text(json.dumps({
                "size_bytes": size * 2, "limit": args.limit, "lean_limit": args.lean_limit, "device": args.device,
                "model": args.model, "gguf": args.gguf, "processes": args.processes, "done": done, "results": results},
                indent=1))
            part.replace(args.json)

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
            if args.device.startswith("cuda") and run(args, "warm-up").wait(timeout=1800) != 0:
                raise RuntimeError("the warm-up's forward on the device failed")
            for kind in contenders:
                (folder / f"output-{kind}.pt").unlink(missing_ok=True)  # never an earlier run's
                try:
                    results[kind] = one(args, kind)
                    if args.processes and kind in ("vramd",) + PEERS:  # vramd-lean's host memory is vramd's
                        results[kind]["pss_processes"] = held_together(args, kind)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run is said, the others go on
                    results[kind] = {"error": str(e)}
                save(done=False)
        finally:
            daemon.terminate()
            daemon.wait(60)
    save(done=True)

    mib = 1 << 20
    print(f"{cls.__name__} ({args.model}), {size * 2 / mib:.1f} MiB at rest in bfloat16, computed in {compute} on "
          f"{args.device} under a limit of {args.limit / mib:.1f} MiB (a quarter; vramd-lean "
          f"{args.lean_limit / mib:.1f} MiB, twice the largest unit), {args.forwards} forwards, {os.cpu_count()} cores")
    for kind, r in results.items():
        if "error" in r:
            print(f"  {kind:14s} failed: {r['error']}")
            continue
        spread = r["forward_seconds"] or [r["forward_median_seconds"]]
        print(f"  {kind:14s} forward {r['forward_median_seconds']:.3f} s ({min(spread):.3f}-{max(spread):.3f}), "
              f"peak {r['peak'] / mib:7.1f} MiB, first output "
              f"{r['first_output_seconds']:.2f} s from the process's start ({r['after_imports_seconds']:.2f} s after "
              f"torch and diffusers are imported: context {r['phases']['context']:.2f} s, module ready "
              f"{r['phases']['ready']:.2f} s, first forward {r['phases']['first_forward']:.2f} s)"
              + (f", {args.processes} processes' PSS {r['pss_processes'] / mib:.1f} MiB" if "pss_processes" in r else ""))
    ran = {kind: r for kind, r in results.items() if "error" not in r}
    # Each vramd contender against the peers holding the same values at rest: bfloat16, or the
    # GGUF file's blocks.
    for ours, peers in (("vramd", PEERS), ("vramd-sync", ("vramd",) + PEERS), ("vramd-lean", PEERS),
                        ("vramd-gguf", ("diffusers-gguf", "vramd"))):
        v = ran.get(ours)
        for kind in (peer for peer in peers if v and peer in ran):
            r = ran[kind]
            print(f"{ours} against {kind}: forward {r['forward_median_seconds'] / v['forward_median_seconds']:.2f}x "
                  f"faster, peak {v['peak'] / r['peak']:.2f}x, first output "
                  f"{r['first_output_seconds'] / v['first_output_seconds']:.1f}x sooner "
                  f"({r['after_imports_seconds'] / v['after_imports_seconds']:.1f}x after the imports)"
                  + (f", {args.processes} processes' PSS {v['pss_processes'] / r['pss_processes']:.2f}x"
                     if "pss_processes" in v and "pss_processes" in r else "")
                  + (f", bytes read from host memory {v['managed']['bytes_read'] / r['managed']['bytes_read']:.2f}x"
                     if "managed" in r else ""))
    if "resident" in ran:  # the bound: what each way of offloading adds to a forward
        bound = ran["resident"]["forward_median_seconds"]
        print(f"forward against the module resident on {args.device} ({bound:.3f} s): " + ", ".join(
            f"{kind} {r['forward_median_seconds'] / bound:.2f}x" for kind, r in ran.items() if kind != "resident"))
    for kind, r in ran.items():
        if "managed" in r:
            m = r["managed"]
            print(f"{kind}'s manager: peak {m['peak']} of its {m['limit']}-byte limit (the least it runs under: "
                  f"{m['least_limit']}), {m['loads']} unit loads, "
                  f"{m['bytes_read'] / mib:.1f} MiB read from host memory, {m['prefetch_hits']} prefetched in time; "
                  f"in {args.forwards} calls, {m['hook_seconds']:.3f} s in its hooks, {m['waited_seconds']:.3f} s of "
                  f"them waiting for prefetches; {m['pin_seconds']:.3f} s page-locking {m['pinned_bytes'] / mib:.1f} MiB of the lease when "
                  "ready")
    # The outputs, a witness that each computed the same module: the peers' against vramd's from the
    # same values (from the GGUF file, vramd-gguf's).
    for kind in ran:
        reference = "vramd-gguf" if kind.endswith("gguf") else "vramd"
        if kind == reference or not (folder / f"output-{reference}.pt").exists():
            continue
        ours, theirs = (torch.load(folder / f"output-{k}.pt") for k in (reference, kind))
        print(f"{kind}'s first output against {reference}'s: "
              + ("equal bit for bit" if torch.equal(ours, theirs) else
                 f"largest difference {(ours - theirs).abs().max().item():.3g} "
                 f"(values up to {ours.abs().max().item():.3g})"))


if __name__ == "__main__":
    main()
