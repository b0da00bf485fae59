"""A mixture of experts larger than its memory limit: vramd, which brings in only the experts a
batch is routed to and keeps the most routed resident (docs/models.md, "Mixtures of experts"),
against transformers + accelerate's offload at the same limit (`device_map="auto"` with
`max_memory`), on the same checkpoint and the same sequence of inputs.

    .venv/bin/python bench/moe.py [--device cpu|cuda:0] [--tokens 1] [--forwards 12] [--workdir DIR]

The model: Mixtral-shaped (8 experts a layer, 2 chosen per token), random bfloat16 weights saved
by transformers; the limit: --limit of its bytes (default 0.4). Each forward is a new batch of
--tokens random tokens (1: a decoding step; more: a prompt), the same batches for both.

  vramd       the daemon serves the checkpoint with [vram].limit; onload: disk on the CPU (the
              checkpoint's pages), host memory on a GPU. Bytes moved per forward: what the
              daemon's weights figures say it brought to the computation device (bytes_streamed),
              and of those the experts'.
  vramd, experts on the CPU  (a GPU only) the same limit with [vram].experts = "cpu": every
              expert computed on the CPU from host memory, as llama.cpp's --cpu-moe does.
  accelerate  AutoModelForCausalLM.from_pretrained(device_map="auto", max_memory={computation
              device: limit, ...}); on the CPU the rest is offloaded to disk (offload_folder), on
              a GPU to host memory. Its hooks bring each offloaded module's weights in whole when
              the module runs, every expert of a layer at once: bytes moved per forward are those
              modules' bytes, from its device map.

Printed: each one's forward (the median of those after the first), bytes moved per forward, and
vramd's ratios (accelerate's forward over vramd's; vramd's bytes over accelerate's). Goals (issue
#47): 3x accelerate's forward, under a fifth of its bytes. The outputs are compared: bit-exact is
not expected (accelerate computes the experts fused), equal to bfloat16's precision is.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from vram import serving  # noqa: E402

VRAMD = Path(os.environ.get("VRAMD", ROOT / "build" / "bin" / "vramd"))
MiB = 2**20


def config(layers):
    import transformers
    return transformers.MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
                                      num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                                      num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)


def checkpoint(folder, layers):
    """The checkpoint as transformers saves it (per-expert keys), made once per shape."""
    if (folder / "config.json").exists():
        return
    import transformers
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config(layers)).to(torch.bfloat16)
    model.save_pretrained(folder)


def batches(count, tokens):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32000, (1, tokens), generator=generator) for _ in range(count)]


def vramd_contender(work, folder, device, limit, inputs, experts="stream"):
    models = work / "models"
    models.mkdir(exist_ok=True)
    onload = '{ device = "disk" }' if device == "cpu" else '{ device = "cpu" }'
    (models / "moe.toml").write_text(f'checkpoint = "{folder}"\n[vram]\ncomputation = {{ device = "{device}" }}\n'
                                     f'offload = {{ device = "disk" }}\nonload = {onload}\nlimit = {limit}\n'
                                     f'experts = "{experts}"\n')
    with serving(work, 'cpu = "64GiB"\n"cuda:0" = "64GiB"', VRAMD) as client:
        client.load("moe")
        times, outputs, figures = [], [], []
        for ids in inputs:
            start = time.perf_counter()
            outputs.append(client.forward("moe", {"input_ids": ids})["logits"])
            times.append(time.perf_counter() - start)
            figures.append(client.status("moe")["weights"])
    # Per forward after the first: the differences of the running totals.
    streamed = [b["bytes_streamed"] - a["bytes_streamed"] for a, b in zip(figures, figures[1:])]
    experts = [b["experts"]["bytes_streamed"] - a["experts"]["bytes_streamed"] for a, b in zip(figures, figures[1:])]
    last = figures[-1]
    return {"forward": statistics.median(times[1:]), "moved": statistics.mean(streamed),
            "experts_moved": statistics.mean(experts), "peak": last["peak"], "experts": last["experts"],
            "plan": last["plan"]}, outputs


def accelerate_contender(spec):
    """In a process of its own (--contender): from_pretrained under max_memory, the forwards."""
    import transformers
    device = spec["device"]
    max_memory = {"cpu": spec["limit"]} if device == "cpu" else {0: spec["limit"], "cpu": 64 * 2**30}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["folder"], device_map="auto", max_memory=max_memory, offload_folder=spec["offload"], dtype=torch.bfloat16)
    model.eval()
    execution = torch.device(device)
    inputs = load_file(spec["inputs"])
    times, logits = [], {}
    with torch.no_grad():
        for i in range(len(inputs)):
            ids = inputs[str(i)].to(execution)
            start = time.perf_counter()
            out = model(input_ids=ids).logits
            if execution.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            logits[str(i)] = out.float().cpu().contiguous()
    offloaded, placed = 0, {}
    for name, where in model.hf_device_map.items():
        module = model.get_submodule(name) if name else model
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        placed[str(where)] = placed.get(str(where), 0) + nbytes
        if str(where) == "disk" or (str(where) == "cpu" and device != "cpu"):  # away from the computation
            offloaded += nbytes
    save_file(logits, spec["logits"])
    Path(spec["result"]).write_text(json.dumps({"times": times, "offloaded": offloaded, "placed": placed,
                                                "version": transformers.__version__}))


def accelerate_run(work, folder, device, limit, inputs):
    spec = {"folder": str(folder), "device": device, "limit": limit, "inputs": str(work / "inputs.safetensors"),
            "offload": str(work / "accelerate-offload"), "logits": str(work / "accelerate.safetensors"),
            "result": str(work / "accelerate.json")}
    save_file({str(i): ids for i, ids in enumerate(inputs)}, spec["inputs"])
    done = subprocess.run([sys.executable, __file__, "--contender", json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"accelerate failed: {done.stderr[-3000:]}")
    r = json.loads(Path(spec["result"]).read_text())
    logits = load_file(spec["logits"])
    return {"forward": statistics.median(r["times"][1:]), "moved": r["offloaded"], "placed": r["placed"],
            "version": r["version"]}, [logits[str(i)] for i in range(len(inputs))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--forwards", type=int, default=12)
    parser.add_argument("--limit", type=float, default=0.4, help="of the checkpoint's bytes")
    parser.add_argument("--workdir", default="/tmp/vramd-bench-moe")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--contender")
    args = parser.parse_args()
    if args.contender:
        return accelerate_contender(json.loads(args.contender))

    work = Path(args.workdir)
    folder = work / f"mixtral-{args.layers}"
    checkpoint(folder, args.layers)
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    limit = int(total * args.limit)
    inputs = batches(args.forwards, args.tokens)
    v, v_out = vramd_contender(work, folder, args.device, limit, inputs)
    # On a GPU, also every expert computed on the CPU (llama.cpp's --cpu-moe) under the same limit.
    cpu_experts = vramd_contender(work, folder, args.device, limit, inputs, "cpu")[0] if args.device != "cpu" else None
    a, a_out = accelerate_run(work, folder, args.device, limit, inputs)
    error = max(((x.float().cpu() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(v_out, a_out))
    figures = {"device": args.device, "checkpoint_bytes": total, "limit": limit, "tokens": args.tokens,
               "forwards": args.forwards, "vramd": v, "accelerate": a, "logits_relative_error": error,
               "forward_ratio": a["forward"] / v["forward"], "bytes_ratio": v["moved"] / a["moved"],
               "vramd_experts_on_cpu": cpu_experts}
    print(f"Mixtral-shaped, {args.layers} layers of 8 experts (2 per token), {total / MiB:.0f} MiB in bfloat16, "
          f"limit {limit / MiB:.0f} MiB ({args.limit:.2f}), on {args.device}; {args.forwards} forwards of "
          f"{args.tokens} new token(s) each")
    print(f"  vramd: {v['plan']}")
    print(f"  accelerate's device map (transformers {a['version']}): "
          + ", ".join(f"{where} {n / MiB:.0f} MiB" for where, n in a["placed"].items()))
    print(f"forward: vramd {v['forward'] * 1e3:.1f} ms, accelerate {a['forward'] * 1e3:.1f} ms: "
          f"{figures['forward_ratio']:.2f}x (goal 3x)")
    print(f"bytes moved per forward: vramd {v['moved'] / MiB:.1f} MiB (experts {v['experts_moved'] / MiB:.1f} MiB), "
          f"accelerate {a['moved'] / MiB:.1f} MiB: {figures['bytes_ratio']:.3f} of accelerate's (goal under 0.2)")
    print(f"vramd's experts: {v['experts']}; peak {v['peak'] / MiB:.1f} MiB of the {limit / MiB:.1f} MiB limit")
    if cpu_experts:
        print(f"vramd with experts = \"cpu\" (computed on the CPU, the rest on {args.device}): forward "
              f"{cpu_experts['forward'] * 1e3:.1f} ms ({a['forward'] / cpu_experts['forward']:.2f}x accelerate's, "
              f"{v['forward'] / cpu_experts['forward']:.2f}x streaming them); {cpu_experts['plan']}")
    print(f"logits: vramd against accelerate, max relative difference {error:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
