"""Streaming under a memory limit: a ~1B-parameter LLaMA-shaped bfloat16 checkpoint (random
weights; bench/load.py makes it), offloaded to disk, limit a quarter of the model, CPU as the
computation device. Every contender runs in a fresh process on the same file, page cache warm.

    .venv/bin/python bench/vram.py [--workdir /tmp/vramd-bench] [--forwards 20] [--tokens 32]

  vramd resident   the whole model in memory: pure compute time
  vramd streamed   [vram] offload = onload = disk, limit = size / 4
  accelerate disk  load_checkpoint_and_dispatch with the decoder layers on "disk" (its offload
                   folder of memory-mapped weights), everything else on the CPU

Prints forward latency (median of the forwards after the first), peak RSS, RSS growth over the
run, vramd's peak weight bytes on the computation device against its limit, and the overlap
efficiency: streamed forward time over max(pure read time, pure compute time), where pure read
time is reading the streamed bytes with positioned reads alone, measured in the same run.
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
VRAMCTL = ROOT / "build" / "bin" / "vramctl"
sys.path.insert(0, str(ROOT / "bench"))
import load as load_bench  # noqa: E402  (makes the checkpoint)


def status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024


def accelerate_contender(folder, tokens, forwards, offload_dir):
    import torch
    import accelerate
    import transformers
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


def vramd_contender(folder, tokens, forwards, workdir, vram):
    import torch
    from safetensors.torch import save_file
    daemon_config = workdir / "vramd.toml"
    daemon_config.write_text('[budgets]\ncpu = "64GiB"\n')
    config = workdir / "model.toml"
    config.write_text(f'checkpoint = "{folder}"\n{vram}')
    inputs = workdir / "in.safetensors"
    save_file({"input_ids": torch.randint(0, 32000, (1, tokens), generator=torch.Generator().manual_seed(0))}, inputs)
    times = []
    stats = workdir / "stats.json"
    subprocess.run([VRAMCTL, "run", config, "--daemon-config", daemon_config, "--input", inputs,
                    "--stats-json", stats, "--repeat", str(forwards), "--copy"], check=True, capture_output=True)
    s = json.loads(stats.read_text())
    return s


def pure_read_seconds(path, nbytes):
    """Positioned reads of `nbytes` of the file into fresh memory, warm cache: the read bound."""
    fd = os.open(path, os.O_RDONLY)
    start, done, chunk = time.perf_counter(), 0, 64 << 20
    while done < nbytes:
        data = os.pread(fd, min(chunk, nbytes - done), 4096 + done)
        done += len(data)
    os.close(fd)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--forwards", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    folder = Path(args.workdir) / "llama1b"
    load_bench.make_checkpoint(folder)
    size = (folder / "model.safetensors").stat().st_size
    limit = size // 4
    subprocess.run(["cat", folder / "model.safetensors"], stdout=subprocess.DEVNULL, check=True)  # warm the cache

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        streamed = ('[vram]\noffload = { device = "disk" }\nonload = { device = "disk" }\n'
                    f"limit = {limit}\n")
        for name, vram in [("vramd resident", ""), ("vramd streamed", streamed)]:
            if args.only and args.only not in name:
                continue
            s = vramd_contender(folder, args.tokens, args.forwards, tmp, vram)
            results[name] = s
            print(f"{name}: forward median {s['forward_median_seconds']:.2f} s (first {s['forward_first_seconds']:.2f} s), "
                  f"peak RSS {s['peak_rss'] / 2**30:.2f} GiB, RSS growth after the first forward "
                  f"{(s['rss_end'] - s['rss_after_first_forward']) / 2**20:.0f} MiB"
                  + (f", peak weights {s['vram']['peak'] / 2**20:.0f} MiB of limit {limit / 2**20:.0f} MiB, "
                     f"{s['vram']['prefetched']}/{s['vram']['loads']} loads prefetched" if "vram" in s else ""),
                  flush=True)
        if not args.only or "accelerate" in args.only:
            script = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'bench')!r}); import vram; "
                      f"print(json.dumps(vram.accelerate_contender(__import__('pathlib').Path({str(folder)!r}), "
                      f"{args.tokens}, {args.forwards}, {str(tmp / 'offload')!r})))")
            out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
            if out.returncode == 0:
                a = json.loads(out.stdout.strip().splitlines()[-1])
                a["forward_median_seconds"] = statistics.median(a["times"][1:] or a["times"])
                results["accelerate disk"] = a
                print(f"accelerate disk: forward median {a['forward_median_seconds']:.2f} s (first {a['times'][0]:.2f} s), "
                      f"peak RSS {a['peak_rss'] / 2**30:.2f} GiB, RSS growth after the first forward "
                      f"{a['rss_growth'] / 2**20:.0f} MiB", flush=True)
            else:
                print("accelerate disk: failed:", out.stderr.strip().splitlines()[-1])

    if "vramd streamed" in results and "vramd resident" in results:
        s = results["vramd streamed"]
        per_forward = s["vram"]["bytes_streamed"] / max(1, s["forwards"])
        read = pure_read_seconds(folder / "model.safetensors", int(per_forward))
        compute = results["vramd resident"]["forward_median_seconds"]
        print(f"overlap efficiency: streamed {s['forward_median_seconds']:.2f} s over max(read {read:.2f} s, "
              f"compute {compute:.2f} s) = {s['forward_median_seconds'] / max(read, compute):.2f}")
        if "accelerate disk" in results:
            print(f"vramd streamed against accelerate disk: "
                  f"{results['accelerate disk']['forward_median_seconds'] / s['forward_median_seconds']:.2f}x faster")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "times"} for k, v in results.items()}))


if __name__ == "__main__":
    main()
