"""Lease benchmark: a complete state dict of the 1.1B bfloat16 LLaMA of bench/load.py in a fresh
Python process, from the call to the last tensor, four ways in the same run:

    lease            vramd.connect().lease(...): the daemon already holds the model
    load_file        safetensors.torch.load_file
    safe_open loop   safetensors.safe_open + get_tensor for each key
    from_pretrained  transformers.AutoModelForCausalLM.from_pretrained (a model, not a dict)

and the same model converted, as the daemon serves it with a float32 computation dtype: its
lease against load_file + .float(). Then a model's first forward: a transformers LLaMA built on
the meta device and filled from the lease, against a from_pretrained model's first and warm
(third) forwards. Last, the memory of four clients at once: the sum of their PSS growth
(/proc/PID/smaps_rollup) over the model's bytes, leases against load_file.

    .venv/bin/python bench/lease.py [--workdir /tmp/vramd-bench] [--repeat 5] [--tokens 32]

The page cache is warm (the file is read once first), imports are outside every timing. See
docs/benchmarks.md.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "python"))
from load import SHAPE, warm_checkpoint  # noqa: E402

VRAMD = ROOT / "build" / "bin" / "vramd"
VRAMCTL = ROOT / "build" / "bin" / "vramctl"


def pss():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def contender(kind, folder, tokens, hold):
    """Runs in its own process: one complete state dict, timed; then, for `forward`, forwards."""
    import torch
    import transformers
    import vramd
    from safetensors import safe_open
    from safetensors.torch import load_file
    torch.set_num_threads(os.cpu_count())
    path = str(folder / "model.safetensors")
    baseline = pss()
    start = time.perf_counter()
    model = None
    lease = None  # held until the process ends
    if kind in ("lease", "forward", "lease float32"):  # llama32: served converted, computation dtype float32
        lease = vramd.connect().lease("llama32" if kind.endswith("float32") else "llama")
        state_dict = lease.state_dict
    elif kind == "load_file":
        state_dict = load_file(path)
    elif kind == "load_file float32":
        state_dict = {k: v.float() for k, v in load_file(path).items()}
    elif kind == "safe_open":
        with safe_open(path, "pt") as f:
            state_dict = {k: f.get_tensor(k) for k in f.keys()}
    elif kind in ("from_pretrained", "forward from_pretrained"):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        state_dict = model.state_dict()
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "tensors": len(state_dict)}
    if kind.startswith("forward"):
        if model is None:
            from accelerate import init_empty_weights
            config = transformers.AutoConfig.from_pretrained(folder)
            with init_empty_weights():
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
            model.load_state_dict(state_dict, strict=False, assign=True)
            model.tie_weights()
        ids = torch.arange(tokens).view(1, tokens) % SHAPE["vocab_size"]
        times = []
        with torch.inference_mode():
            for _ in range(3):
                start = time.perf_counter()
                model(input_ids=ids)
                times.append(time.perf_counter() - start)
        result.update(first_forward=times[0], warm_forward=min(times[1:]))
    if hold:  # touch every page, report, and hold on until told to go
        total = sum(float(t.float().sum()) for t in state_dict.values())
        result["pss"] = pss() - baseline
        result["checksum"] = total
        print(json.dumps(result), flush=True)
        sys.stdin.readline()
    return result


def run_contender(args, kind, hold=False):
    command = [sys.executable, __file__, "--workdir", args.workdir, "--tokens", str(args.tokens), "--contender", kind]
    if hold:
        command.append("--hold")
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ)
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def at_once(args, kind, count):
    """Sum of `count` holding clients' PSS growth."""
    clients = [run_contender(args, kind, hold=True) for _ in range(count)]
    try:
        return sum(json.loads(c.stdout.readline())["pss"] for c in clients)
    finally:
        for c in clients:
            c.stdin.close()
            c.wait(600)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per contender")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(args.workdir) / "llama1b"
    if args.contender:
        print(json.dumps(contender(args.contender, folder, args.tokens, args.hold)))
        return

    size = warm_checkpoint(folder)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "models").mkdir()
        (tmp / "models" / "llama.toml").write_text(f'checkpoint = "{folder}"\n')
        (tmp / "models" / "llama32.toml").write_text(f'checkpoint = "{folder}"\n[vram]\ncomputation = {{ dtype = "float32" }}\n')
        sock = tmp / "vramd.sock"
        (tmp / "vramd.toml").write_text(f'socket = "{sock}"\nmodels = "models"\n')
        os.environ["VRAMD_SOCKET"] = str(sock)
        daemon = subprocess.Popen([VRAMD, "--config", tmp / "vramd.toml"], stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 600
            while subprocess.run([VRAMCTL, "load", "llama"], capture_output=True).returncode != 0:
                assert time.monotonic() < deadline and daemon.poll() is None, "vramd did not start"
                time.sleep(0.5)
            # The converted model's first lease packs it into shared memory, once: not timed.
            subprocess.run([VRAMCTL, "lease", "llama32"], check=True, capture_output=True, timeout=600)
            times = {kind: sorted(run_contender(args, kind)["seconds"] for _ in range(args.repeat))
                     for kind in ("lease", "load_file", "safe_open", "from_pretrained", "lease float32",
                                  "load_file float32")}
            forward = {kind: run_contender(args, kind) for kind in ("forward", "forward from_pretrained")}
            # Four private float32 copies would not fit beside the daemon's in 24 GiB: two of them.
            memory = {kind: (count, at_once(args, kind, count))
                      for kind, count in (("lease", 4), ("load_file", 4), ("lease float32", 4), ("load_file float32", 2))}
        finally:
            daemon.terminate()
            daemon.wait(60)

    median = {kind: t[len(t) // 2] for kind, t in times.items()}
    gib = 1 << 30
    print(f"checkpoint: {size / gib:.2f} GiB bf16, {os.cpu_count()} cores; median of {args.repeat} fresh processes, "
          f"from the call to a complete state dict")
    for kind, t in median.items():
        print(f"  {kind:20s}{t * 1000:10.1f} ms")
    print(f"bfloat16 as stored: lease {median['load_file'] / median['lease']:.1f}x faster than load_file (goal: 100x), "
          f"{median['safe_open'] / median['lease']:.1f}x than the safe_open loop, "
          f"{median['from_pretrained'] / median['lease']:.0f}x than from_pretrained")
    print(f"converted to float32: lease {median['load_file float32'] / median['lease float32']:.0f}x faster than "
          f"load_file + .float()")
    for kind, r in forward.items():
        print(f"{kind}: first forward {r['first_forward']:.3f} s, warm {r['warm_forward']:.3f} s, "
              f"{r['first_forward'] / r['warm_forward']:.2f}x")
    print(f"a leased model's first forward is {forward['forward']['first_forward'] / forward['forward from_pretrained']['warm_forward']:.2f}x "
          f"a warm from_pretrained model's (goal: at most 1.1x)")
    for kind, (count, total) in memory.items():
        model_bytes = size * (2 if kind.endswith("float32") else 1)
        print(f"{count} clients' PSS with {kind}: {total / gib:.2f} GiB, {total / model_bytes:.2f}x the model's "
              f"{model_bytes / gib:.2f} GiB (goal for four leases: at most 1.1x)")

if __name__ == "__main__":
    main()
