"""Converter benchmark: time per 1,000 keys for a rename-only converter over 100,000 keys, and
for a converter with transforms (fused QKV split, rotary permutation, casts) over the index of
a 7B LLaMA-shaped checkpoint. Only indexes are needed: the checkpoints are sparse files whose
data regions read as zeros and take no disk space.

    .venv/bin/python bench/convert.py [--workdir /tmp/vramd-bench] [--repeat 5]

A Python baseline (re.sub over the same key names, as DiffSynth-style converters do) is
printed for scale. See docs/benchmarks.md.
"""
import argparse
import json
import re
import struct
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "build" / "bin" / "vramd_bench_convert"

RULES = r'''
local rules = {
  { "^blocks%.(%d+)%.attn%.to_q%.", "layers.%1.attention.wq." },
  { "^blocks%.(%d+)%.attn%.to_k%.", "layers.%1.attention.wk." },
  { "^blocks%.(%d+)%.attn%.to_v%.", "layers.%1.attention.wv." },
  { "^blocks%.(%d+)%.ff%.", "layers.%1.feed_forward." },
  { "^blocks%.", "layers." },
}
'''
# The one-call way a rename-only converter is written (scripts/converters/README.md), and the
# same renames one key at a time in a Lua loop, as a converter that also transforms does them.
RENAME = RULES + "return src:renamed(rules)\n"
RENAME_LOOP = RULES + r'''
local out = {}
for name, t in src:items() do out[rename(name, rules) or name] = t end
return out
'''

# Meta LLaMA-style fused QKV to Hugging Face names, with the rotary permutation of q and k.
TRANSFORM = r'''
local heads, dim = 32, 4096
local function rotary(t, rows)
  return t:reshape({ rows / (dim / heads) , 2, dim / heads / 2, dim }):transpose(1, 2):reshape({ rows, dim })
end
local names = {
  ["attention.wo.weight"] = "self_attn.o_proj.weight", ["feed_forward.w1.weight"] = "mlp.gate_proj.weight",
  ["feed_forward.w2.weight"] = "mlp.down_proj.weight", ["feed_forward.w3.weight"] = "mlp.up_proj.weight",
  ["attention_norm.weight"] = "input_layernorm.weight", ["ffn_norm.weight"] = "post_attention_layernorm.weight",
}
local out = {}
for name, t in src:items() do
  local layer, rest = name:match("^layers%.(%d+)%.(.+)$")
  if rest == "attention.wqkv.weight" then
    local q, k, v = t:split({ dim, dim, dim }, 0)
    local p = "model.layers." .. layer .. ".self_attn."
    out[p .. "q_proj.weight"] = rotary(q, dim)
    out[p .. "k_proj.weight"] = rotary(k, dim)
    out[p .. "v_proj.weight"] = v
  elseif layer then
    out["model.layers." .. layer .. "." .. names[rest]] = t:cast("bfloat16")
  elseif name == "tok_embeddings.weight" then
    out["model.embed_tokens.weight"] = t
  elseif name == "norm.weight" then
    out["model.norm.weight"] = t
  elseif name == "output.weight" then
    out["lm_head.weight"] = t
  end
end
return out
'''


def sparse_checkpoint(path, tensors):
    """A valid safetensors file whose data region is a hole: {name: (dtype, shape, itemsize)}."""
    header, offset = {}, 0
    for name, (dtype, shape, itemsize) in tensors.items():
        size = itemsize
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)


def timed(script, checkpoint, repeat, workdir, name):
    path = workdir / name
    path.write_text(script)
    out = json.loads(subprocess.run([str(BENCH), path, checkpoint, str(repeat)], check=True,
                                    capture_output=True, text=True).stdout)
    return min(out["seconds"]), out["sources"], out["targets"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)

    many = work / "rename-100k.safetensors"
    names = [f"blocks.{i // 8}.{['attn.to_q', 'attn.to_k', 'attn.to_v', 'ff.net'][i % 4]}.{'weight' if i % 8 < 4 else 'bias'}"
             for i in range(100_000)]
    sparse_checkpoint(many, {n: ("BF16", (4,), 2) for n in names})

    llama = work / "llama-7b-index.safetensors"
    tensors = {"tok_embeddings.weight": ("BF16", (32000, 4096), 2), "norm.weight": ("BF16", (4096,), 2),
               "output.weight": ("BF16", (32000, 4096), 2)}
    for i in range(32):
        p = f"layers.{i}."
        tensors[p + "attention.wqkv.weight"] = ("BF16", (3 * 4096, 4096), 2)
        tensors[p + "attention.wo.weight"] = ("BF16", (4096, 4096), 2)
        for w, shape in (("w1", (11008, 4096)), ("w2", (4096, 11008)), ("w3", (11008, 4096))):
            tensors[p + f"feed_forward.{w}.weight"] = ("BF16", shape, 2)
        tensors[p + "attention_norm.weight"] = ("BF16", (4096,), 2)
        tensors[p + "ffn_norm.weight"] = ("BF16", (4096,), 2)
    sparse_checkpoint(llama, tensors)

    seconds, sources, targets = timed(RENAME, many, args.repeat, work, "rename.lua")
    print(f"rename-only with src:renamed, {sources} keys: {seconds * 1e3:.1f} ms = "
          f"{seconds * 1e3 / (sources / 1000):.3f} ms per 1k keys (goal: under 2)")
    seconds, sources, targets = timed(RENAME_LOOP, many, args.repeat, work, "rename-loop.lua")
    print(f"  the same with rename() in a Lua loop over src:items(): {seconds * 1e3:.1f} ms = "
          f"{seconds * 1e3 / (sources / 1000):.3f} ms per 1k keys")
    rules = [(re.compile(r"^blocks\.(\d+)\.attn\.to_q\."), r"layers.\1.attention.wq."),
             (re.compile(r"^blocks\.(\d+)\.attn\.to_k\."), r"layers.\1.attention.wk."),
             (re.compile(r"^blocks\.(\d+)\.attn\.to_v\."), r"layers.\1.attention.wv."),
             (re.compile(r"^blocks\.(\d+)\.ff\."), r"layers.\1.feed_forward."), (re.compile(r"^blocks\."), "layers.")]

    def python_rename():
        out = {}
        for n in names:
            for pattern, replacement in rules:
                renamed, count = pattern.subn(replacement, n)
                if count:
                    out[renamed] = n
                    break
        return out

    best = min(timeit(python_rename) for _ in range(args.repeat))
    print(f"  Python re.subn baseline over the same keys: {best * 1e3:.1f} ms = {best * 1e3 / 100:.3f} ms per 1k keys")

    seconds, sources, targets = timed(TRANSFORM, llama, args.repeat, work, "transform.lua")
    print(f"transforms, 7B LLaMA-shaped index ({sources} sources -> {targets} targets): {seconds * 1e3:.2f} ms = "
          f"{seconds * 1e3 / (sources / 1000):.3f} ms per 1k keys")


def timeit(function):
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
