#!/usr/bin/env bash
# Builds a checkpoint that holds two models (as diffusion pipelines ship them), then looks at
# the whole file and at one model inside it with vramctl. Run after scripts/setup.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
vramctl="${VRAMCTL:-$root/build/bin/vramctl}"

"$root/.venv/bin/python" - "$work/pipeline.safetensors" <<'PY'
import sys
import torch
from safetensors.torch import save_file
text_encoder = torch.nn.Linear(16, 8)
unet = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.GroupNorm(2, 8))
tensors = {f"text_encoder.{k}": v for k, v in text_encoder.state_dict().items()}
tensors |= {f"unet.{k}": v.to(torch.bfloat16) for k, v in unet.state_dict().items()}
save_file(tensors, sys.argv[1], metadata={"pipeline": "example"})
PY

echo "== the whole file"
"$vramctl" inspect "$work/pipeline.safetensors"
echo
echo "== only the unet, as JSON"
"$vramctl" inspect "$work/pipeline.safetensors" --prefix unet. --json
