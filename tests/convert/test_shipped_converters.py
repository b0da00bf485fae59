"""The converters in scripts/converters, checked against the Python package that defines each
format, on small randomly initialised checkpoints, through vramctl as users run it."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

VRAMCTL = os.environ["VRAMCTL"]
CONVERTERS = Path(__file__).resolve().parents[2] / "scripts" / "converters"


def vramctl(*args):
    return subprocess.run([VRAMCTL, *map(str, args)], capture_output=True, text=True, timeout=300)


def model_config(path, checkpoint, converter, prefix=""):
    path.write_text(f'checkpoint = "{checkpoint}"\nconverter = "{CONVERTERS / converter}"\nprefix = "{prefix}"\n')
    return path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2Model(config).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def test_the_gpt2_converter_plans_every_weight_with_linear_shapes(gpt2, tmp_path):
    model, folder = gpt2
    config = model_config(tmp_path / "gpt2.toml", folder, "hf_gpt2.lua")
    result = vramctl("convert", config, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    tensors = doc["tensors"]
    assert len(tensors) == 4 + 2 * 16  # embeddings, final norm, 16 per layer
    assert tensors["layers.1.attn.q_proj.weight"]["shape"] == [32, 32]
    assert tensors["layers.1.attn.q_proj.weight"]["expression"] == \
        "transpose(narrow(src['h.1.attn.c_attn.weight'], 1, 0, 32), 0, 1)"
    assert tensors["layers.0.mlp.fc_in.weight"]["shape"] == [128, 32]
    assert tensors["layers.0.mlp.fc_out.weight"]["shape"] == [32, 128]
    assert tensors["embed_tokens.weight"]["dtype"] == "F32"
    assert doc["unused"] == []


def test_gpt2_weights_converted_by_vramd_compute_what_transformers_computes(gpt2, tmp_path):
    model, folder = gpt2
    config = model_config(tmp_path / "gpt2.toml", folder, "hf_gpt2.lua")
    result = vramctl("convert", config, "--output", tmp_path / "converted.safetensors")
    assert result.returncode == 0, result.stderr
    w = load_file(tmp_path / "converted.safetensors")
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        for i, block in enumerate(model.h):
            p = f"layers.{i}."
            q, k, v = block.attn.c_attn(x).split(32, dim=-1)  # transformers' Conv1D, fused
            assert torch.allclose(F.linear(x, w[p + "attn.q_proj.weight"], w[p + "attn.q_proj.bias"]), q, atol=1e-6)
            assert torch.allclose(F.linear(x, w[p + "attn.k_proj.weight"], w[p + "attn.k_proj.bias"]), k, atol=1e-6)
            assert torch.allclose(F.linear(x, w[p + "attn.v_proj.weight"], w[p + "attn.v_proj.bias"]), v, atol=1e-6)
            assert torch.allclose(F.linear(x, w[p + "attn.out_proj.weight"], w[p + "attn.out_proj.bias"]),
                                  block.attn.c_proj(x), atol=1e-6)
            h = F.linear(x, w[p + "mlp.fc_in.weight"], w[p + "mlp.fc_in.bias"])
            assert torch.allclose(h, block.mlp.c_fc(x), atol=1e-6)
            assert torch.allclose(F.linear(h, w[p + "mlp.fc_out.weight"], w[p + "mlp.fc_out.bias"]),
                                  block.mlp.c_proj(h), atol=1e-5)
            assert torch.equal(w[p + "ln_1.weight"], block.ln_1.weight)
        assert torch.equal(w["embed_tokens.weight"], model.wte.weight)
        assert torch.equal(w["embed_positions.weight"], model.wpe.weight)
        assert torch.equal(w["norm.bias"], model.ln_f.bias)


def test_a_gpt2_lm_head_checkpoint_converts_with_its_prefix(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "lm", safe_serialization=True)
    keys = load_file(next((tmp_path / "lm").glob("*.safetensors"))).keys()
    prefix = "transformer." if any(k.startswith("transformer.") for k in keys) else ""
    result = vramctl("convert", model_config(tmp_path / "lm.toml", tmp_path / "lm", "hf_gpt2.lua", prefix), "--json")
    assert result.returncode == 0, result.stderr
    assert "layers.0.attn.k_proj.weight" in json.loads(result.stdout)["tensors"]
