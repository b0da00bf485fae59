"""Loading benchmark: time to ready and peak memory for a ~1B-parameter LLaMA-shaped bfloat16
checkpoint (random weights), vramd against transformers and accelerate, and against the fastest
loaders (runai-model-streamer, fastsafetensors: bench/peer_read.py's reads put into a model made
without weights, load_state_dict(assign=True)), same file, same run.

    .venv/bin/python bench/load.py [--workdir /tmp/vramd-bench] [--repeat 3] [--tokens 32]

Every contender loads in a fresh process with the page cache warm (the file is read once
first). "ready" is the time of the load call alone (vramd: index + plan + materialise;
Python: from_pretrained or load_checkpoint_and_dispatch, imports excluded). Peak RSS is the
process's VmHWM; "+load" is its growth over the RSS just before loading. The first forward
is timed separately because a zero-copy load pays its page faults there. See docs/benchmarks.md.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VRAMCTL = ROOT / "build" / "bin" / "vramctl"
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)


def make_checkpoint(folder, shape=SHAPE):
    import torch
    import transformers
    from safetensors.torch import save_file
    if (folder / "model.safetensors").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**shape, dtype="bfloat16")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(p.shape, generator=generator) * 0.02).to(torch.bfloat16)
               for name, p in model.state_dict().items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)


def warm_checkpoint(folder, shape=SHAPE):
    """Makes the checkpoint when missing and reads it once, so that the page cache holds it; its size."""
    make_checkpoint(folder, shape)
    subprocess.run(["cat", str(folder / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)
    return (folder / "model.safetensors").stat().st_size


def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss():
    """VmHWM: unlike ru_maxrss it starts afresh at exec, so the parent's memory is not counted."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def time_forwards(model, tokens, vocab, repeat):
    """`repeat` forwards of `tokens` token ids under inference mode: the first's seconds and the median's."""
    import torch
    ids = torch.arange(tokens).view(1, tokens) % vocab
    times = []
    with torch.inference_mode():
        for _ in range(repeat):
            start = time.perf_counter()
            model(input_ids=ids)
            times.append(time.perf_counter() - start)
    return times[0], sorted(times)[len(times) // 2]


def python_contender(kind, folder, tokens, repeat):
    """Runs in its own process: loads one way, times it, runs forwards."""
    import torch
    import transformers
    torch.set_num_threads(os.cpu_count())
    before = rss_now()
    start = time.perf_counter()
    if kind == "transformers":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    elif kind == "transformers-device-map":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cpu")
    elif kind == "accelerate":
        import accelerate
        config = transformers.AutoConfig.from_pretrained(folder)
        with accelerate.init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model = accelerate.load_checkpoint_and_dispatch(model, str(folder / "model.safetensors"), device_map={"": "cpu"},
                                                        dtype=torch.bfloat16)
    else:  # a fast loader's tensors put into a model made without weights, as vLLM's loaders do
        import accelerate
        import peer_read
        peer_read.imports(kind)
        start = time.perf_counter()  # the loader's imports left out, as transformers' are
        config = transformers.AutoConfig.from_pretrained(folder)
        with accelerate.init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(peer_read.read(kind, str(folder / "model.safetensors")), assign=True)
    ready = time.perf_counter() - start
    loaded_peak = peak_rss()
    model.eval()
    first, median = time_forwards(model, tokens, SHAPE["vocab_size"], repeat)
    return {"ready": ready, "rss_before": before, "peak_loaded": loaded_peak, "first_forward": first,
            "median_forward": median, "peak_end": peak_rss()}


def vramd_contender(folder, tokens, repeat, workdir, *flags):
    import torch
    from safetensors.torch import save_file
    config = workdir / "llama1b.toml"
    config.write_text(f'checkpoint = "{folder}"\n')
    inputs = workdir / "load-inputs.safetensors"
    save_file({"input_ids": (torch.arange(tokens).view(1, tokens) % SHAPE["vocab_size"]).contiguous()}, inputs)
    stats = workdir / "load-stats.json"
    subprocess.run([VRAMCTL, "run", config, "-i", inputs, "--repeat", str(repeat), "--stats-json", stats, *flags],
                   check=True, capture_output=True, timeout=1800)
    s = json.loads(stats.read_text())
    return {"ready": s["plan_seconds"] + s["load_seconds"], "rss_before": s["peak_rss_before_load"],
            "peak_loaded": s["peak_rss_loaded"], "first_forward": s["forward_first_seconds"],
            "median_forward": s["forward_median_seconds"], "peak_end": s["peak_rss"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--repeat", type=int, default=3, help="forwards per contender")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    folder = workdir / "llama1b"
    if args.contender:
        print(json.dumps(python_contender(args.contender, folder, args.tokens, args.repeat)))
        return

    size = warm_checkpoint(folder)
    results = {"vramd": vramd_contender(folder, args.tokens, args.repeat, workdir),
               "vramd --copy": vramd_contender(folder, args.tokens, args.repeat, workdir, "--copy")}
    for kind in ["transformers", "transformers-device-map", "accelerate", "runai", "fastsafetensors"]:
        out = subprocess.run([sys.executable, __file__, "--workdir", str(workdir), "--repeat", str(args.repeat),
                              "--tokens", str(args.tokens), "--contender", kind],
                             check=True, capture_output=True, text=True, timeout=1800)
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])

    gib = 1 << 30
    print(f"checkpoint: {size / gib:.2f} GiB bf16, {os.cpu_count()} cores, forward on {args.tokens} tokens")
    print(f"{'':24s}{'ready s':>9s}{'peak RSS at ready':>19s}{'+load':>8s}{'1st fwd s':>11s}{'fwd s':>8s}"
          f"{'peak RSS at end':>17s}  (GiB)")
    for name, r in results.items():
        print(f"{name:24s}{r['ready']:9.3f}{r['peak_loaded'] / gib:19.2f}{(r['peak_loaded'] - r['rss_before']) / gib:8.2f}"
              f"{r['first_forward']:11.3f}{r['median_forward']:8.3f}{r['peak_end'] / gib:17.2f}")
    peers = [r for k, r in results.items() if not k.startswith("vramd")]
    best = {key: min(r[key] for r in peers) for key in ("ready", "peak_end", "median_forward")}
    best_ready_first = min(r["ready"] + r["first_forward"] for r in peers)
    for name in ("vramd", "vramd --copy"):
        ours = results[name]
        print(f"{name}: ready {best['ready'] / ours['ready']:.1f}x faster than the best peer, ready + first forward "
              f"{best_ready_first / (ours['ready'] + ours['first_forward']):.2f}x; peak RSS at end "
              f"{ours['peak_end'] / best['peak_end']:.2f}x the best peer's; forward {ours['median_forward'] / best['median_forward']:.2f}x its time")


if __name__ == "__main__":
    main()
