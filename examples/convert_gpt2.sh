#!/usr/bin/env bash
# Saves a tiny randomly initialised GPT-2 with transformers, describes it with a model config
# that names the shipped converter hf_gpt2.lua, then shows the conversion plan and writes the
# converted checkpoint with vramctl. Run after scripts/setup.
#
# hf_gpt2.lua is an example of splitting and transposing: vramd's gpt2 family loads GPT-2
# checkpoints as they are, so `vramctl check` of this config would fail on the renamed keys
# (drop the converter line and it loads). scripts/converters/README.md has converters a model needs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
vramctl="${VRAMCTL:-$root/build/bin/vramctl}"

"$root/.venv/bin/python" - "$work/gpt2" <<'PY'
import sys
import transformers
transformers.logging.disable_progress_bar()
config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                 bos_token_id=0, eos_token_id=0)
transformers.GPT2Model(config).save_pretrained(sys.argv[1], safe_serialization=True)
PY

cat > "$work/gpt2.toml" <<TOML
checkpoint = "gpt2"
converter = "$root/scripts/converters/hf_gpt2.lua"
TOML

echo "== the plan: target keys, dtypes, shapes, and the expressions that make them"
"$vramctl" convert "$work/gpt2.toml"
echo
echo "== evaluated and written"
"$vramctl" convert "$work/gpt2.toml" --output "$work/converted.safetensors"
"$vramctl" inspect "$work/converted.safetensors" | tail -n 4
