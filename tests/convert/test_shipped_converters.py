"""The converters in scripts/converters, checked against the Python package that defines each
format, on small randomly initialised checkpoints, through vramctl as users run it."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

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


def meta_rotary(x, theta=10000.0):
    """Meta's published rotary embedding: consecutive pairs of each head's dimensions as complex
    numbers, multiplied by e^(i * position * frequency). x: [batch, seq, heads, head_dim]."""
    head_dim, seq = x.shape[-1], x.shape[1]
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotation).flatten(3)


def test_meta_llama_weights_converted_by_vramd_load_into_transformers_and_keep_attention(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    dim, heads, kv_heads, layers, hidden, vocab = 64, 4, 2, 2, 96, 50
    head_dim = dim // heads
    meta = {"tok_embeddings.weight": torch.randn(vocab, dim), "norm.weight": torch.rand(dim),
            "output.weight": torch.randn(vocab, dim), "rope.freqs": torch.rand(head_dim // 2)}
    for i in range(layers):
        p = f"layers.{i}."
        meta |= {p + "attention.wq.weight": torch.randn(dim, dim), p + "attention.wk.weight": torch.randn(kv_heads * head_dim, dim),
                 p + "attention.wv.weight": torch.randn(kv_heads * head_dim, dim), p + "attention.wo.weight": torch.randn(dim, dim),
                 p + "feed_forward.w1.weight": torch.randn(hidden, dim), p + "feed_forward.w2.weight": torch.randn(dim, hidden),
                 p + "feed_forward.w3.weight": torch.randn(hidden, dim), p + "attention_norm.weight": torch.rand(dim),
                 p + "ffn_norm.weight": torch.rand(dim)}
    (tmp_path / "meta").mkdir()
    torch.save(meta, tmp_path / "meta" / "consolidated.00.pth")
    config = tmp_path / "llama.toml"
    config.write_text(f'checkpoint = "meta"\nconverter = "{CONVERTERS / "meta_llama.lua"}"\n[arch]\nn_heads = {heads}\n')
    result = vramctl("convert", config, "--output", tmp_path / "hf.safetensors")
    assert result.returncode == 0, result.stderr
    converted = load_file(tmp_path / "hf.safetensors")

    # Every name and shape is what transformers' LlamaForCausalLM expects.
    hf_config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=kv_heads, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(converted, strict=True)

    # Attention scores after rotary embedding: Meta's formula on Meta's weights equals
    # transformers' rotary embedding on the converted weights.
    x = torch.randn(1, 7, dim)
    position_ids = torch.arange(7)[None]
    cos, sin = model.model.rotary_emb(x, position_ids)
    for i in range(layers):
        wq, wk = meta[f"layers.{i}.attention.wq.weight"], meta[f"layers.{i}.attention.wk.weight"]
        q_meta = meta_rotary((x @ wq.T).view(1, 7, heads, head_dim))
        k_meta = meta_rotary((x @ wk.T).view(1, 7, kv_heads, head_dim)).repeat_interleave(heads // kv_heads, dim=2)
        attention = model.model.layers[i].self_attn
        q_hf = attention.q_proj(x).view(1, 7, heads, head_dim).transpose(1, 2)
        k_hf = attention.k_proj(x).view(1, 7, kv_heads, head_dim).transpose(1, 2)
        q_hf, k_hf = modeling_llama.apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
        k_hf = modeling_llama.repeat_kv(k_hf, heads // kv_heads)
        scores_meta = torch.einsum("bshd,bthd->bhst", q_meta, k_meta)
        scores_hf = q_hf @ k_hf.transpose(-1, -2)
        assert torch.allclose(scores_meta, scores_hf, atol=1e-4, rtol=1e-5), (scores_meta - scores_hf).abs().max()


@pytest.mark.parametrize("variant", ["sd3", "sd3.5"])
def test_diffusers_sd3_converted_by_vramd_is_what_diffusers_converts_back(tmp_path, variant):
    diffusers = pytest.importorskip("diffusers")
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    torch.manual_seed(0)
    options = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
                   num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                   pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16)
    if variant == "sd3.5":
        options |= dict(qk_norm="rms_norm", dual_attention_layers=(0, 1))
    model = diffusers.SD3Transformer2DModel(**options)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()  # zero-initialised modulations would hide a swap
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, tmp_path / "diffusers.safetensors")
    config = tmp_path / "sd3.toml"
    config.write_text(f'checkpoint = "diffusers.safetensors"\nconverter = "{CONVERTERS / "diffusers_sd3.lua"}"\n')
    result = vramctl("convert", config, "--output", tmp_path / "original.safetensors")
    assert result.returncode == 0, result.stderr
    original = dict(load_file(tmp_path / "original.safetensors"))
    assert any(k.startswith("joint_blocks.0.x_block.attn.qkv") for k in original)

    back = convert_sd3_transformer_checkpoint_to_diffusers(dict(original))
    assert sorted(back) == sorted(state)
    for key in state:
        assert torch.equal(back[key], state[key]), key


def meta_checkpoint(dim, heads, kv_heads, layers, hidden, vocab):
    """A LLaMA checkpoint in Meta's names and layout, whole (as model parallel size 1 saves it)."""
    head_dim = dim // heads
    meta = {"tok_embeddings.weight": torch.randn(vocab, dim), "norm.weight": torch.rand(dim),
            "output.weight": torch.randn(vocab, dim), "rope.freqs": torch.rand(head_dim // 2)}
    for i in range(layers):
        p = f"layers.{i}."
        meta |= {p + "attention.wq.weight": torch.randn(dim, dim),
                 p + "attention.wk.weight": torch.randn(kv_heads * head_dim, dim),
                 p + "attention.wv.weight": torch.randn(kv_heads * head_dim, dim),
                 p + "attention.wo.weight": torch.randn(dim, dim),
                 p + "feed_forward.w1.weight": torch.randn(hidden, dim), p + "feed_forward.w2.weight": torch.randn(dim, hidden),
                 p + "feed_forward.w3.weight": torch.randn(hidden, dim), p + "attention_norm.weight": torch.rand(dim),
                 p + "ffn_norm.weight": torch.rand(dim)}
    return meta


def meta_split(meta, shards, embedding_dim):
    """The whole checkpoint as Meta's model-parallel ranks hold it: ColumnParallelLinear (wq, wk,
    wv, w1, w3, output) keeps a block of rows, RowParallelLinear (wo, w2) of columns, the
    embedding a block of columns (LLaMA 1 and 2's ParallelEmbedding) or of rows (LLaMA 3's
    VocabParallelEmbedding), and every rank holds the norms and rope.freqs whole."""
    def along(name):
        if name in ("norm.weight", "rope.freqs") or name.endswith("_norm.weight"):
            return None
        if name == "tok_embeddings.weight":
            return embedding_dim
        return 1 if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else 0
    return [{name: (t if along(name) is None else t.chunk(shards, along(name))[rank]).clone()
             for name, t in meta.items()} for rank in range(shards)]


def transformers_conversion(files, heads, kv_heads, embedding_dim):
    """Hugging Face names from Meta's shards by the rules of transformers' LLaMA conversion
    script (convert_llama_weights_to_hf): each tensor concatenated across the files along the
    dimension its layer splits, the norms taken from the first file, and q and k rows permuted
    from interleaved rotary pairs to halves."""
    def permute(w, n_heads):
        rows, columns = w.shape
        return w.view(n_heads, rows // n_heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)

    def joined(name, dim):
        return torch.cat([f[name] for f in files], dim=dim)

    hf = {"model.embed_tokens.weight": joined("tok_embeddings.weight", embedding_dim),
          "model.norm.weight": files[0]["norm.weight"], "lm_head.weight": joined("output.weight", 0)}
    layers = 1 + max(int(name.split(".")[1]) for name in files[0] if name.startswith("layers."))
    for i in range(layers):
        m, p = f"layers.{i}.", f"model.layers.{i}."
        hf |= {p + "self_attn.q_proj.weight": permute(joined(m + "attention.wq.weight", 0), heads),
               p + "self_attn.k_proj.weight": permute(joined(m + "attention.wk.weight", 0), kv_heads),
               p + "self_attn.v_proj.weight": joined(m + "attention.wv.weight", 0),
               p + "self_attn.o_proj.weight": joined(m + "attention.wo.weight", 1),
               p + "mlp.gate_proj.weight": joined(m + "feed_forward.w1.weight", 0),
               p + "mlp.down_proj.weight": joined(m + "feed_forward.w2.weight", 1),
               p + "mlp.up_proj.weight": joined(m + "feed_forward.w3.weight", 0),
               p + "input_layernorm.weight": files[0][m + "attention_norm.weight"],
               p + "post_attention_layernorm.weight": files[0][m + "ffn_norm.weight"]}
    return hf


# (shards, heads, kv_heads, the embedding's split dimension): LLaMA 2-13B's two files and its
# ParallelEmbedding; four files of a grouped-query model with LLaMA 3's VocabParallelEmbedding.
@pytest.mark.parametrize("shards,heads,kv_heads,embedding_dim", [(2, 8, 8, 1), (4, 8, 4, 0)])
def test_meta_llama_in_several_files_is_what_transformers_converts_and_computes(
        tmp_path, shards, heads, kv_heads, embedding_dim):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(shards)
    dim, layers, hidden, vocab = 64, 2, 96, 48
    files = meta_split(meta_checkpoint(dim, heads, kv_heads, layers, hidden, vocab), shards, embedding_dim)
    folder = tmp_path / "llama-meta"
    folder.mkdir()
    for rank, tensors in enumerate(files):
        torch.save(tensors, folder / f"consolidated.{rank:02d}.pth")
    (folder / "params.json").write_text(json.dumps({"dim": dim, "n_heads": heads, "n_kv_heads": kv_heads}))
    expected = transformers_conversion(files, heads, kv_heads, embedding_dim)

    config = tmp_path / "llama.toml"
    config.write_text(f'checkpoint = "{folder}"\nconverter = "{CONVERTERS / "meta_llama.lua"}"\n'
                      f'architecture = "llama"\n[arch]\nhidden_size = {dim}\nnum_attention_heads = {heads}\n'
                      f'num_key_value_heads = {kv_heads}\nnum_hidden_layers = {layers}\n'
                      f'intermediate_size = {hidden}\nvocab_size = {vocab}\nrms_norm_eps = 1e-5\n')
    result = vramctl("convert", config, "--output", tmp_path / "hf.safetensors")
    assert result.returncode == 0, result.stderr
    converted = load_file(tmp_path / "hf.safetensors")
    assert sorted(converted) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name

    hf_config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                                         tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(expected, strict=True)
    ids = torch.tensor([[1, 7, 30, 2, 47, 11], [5, 5, 9, 40, 3, 0]])
    save_file({"input_ids": ids}, tmp_path / "in.safetensors")
    result = vramctl("run", config, "--input", tmp_path / "in.safetensors", "--output", tmp_path / "out.safetensors")
    assert result.returncode == 0, result.stderr
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    got = load_file(tmp_path / "out.safetensors")["logits"]
    assert ((got - logits).abs().max() / logits.abs().max()).item() <= 1e-5


def test_meta_llama_with_its_params_json_needs_no_arch(tmp_path):
    """Meta's folder as Meta ships it: params.json gives the hyperparameters, read by the rules of
    transformers' conversion script (the MLP's width from dim, multiple_of and
    ffn_dim_multiplier; vocab_size -1 counted from output.weight); the logits are transformers'."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    dim, heads, kv_heads, layers, vocab, multiple_of, multiplier = 64, 8, 4, 2, 48, 32, 1.3
    hidden = multiple_of * ((int(multiplier * int(8 * dim / 3)) + multiple_of - 1) // multiple_of)
    files = meta_split(meta_checkpoint(dim, heads, kv_heads, layers, hidden, vocab), 2, 0)
    folder = tmp_path / "llama-meta"
    folder.mkdir()
    for rank, tensors in enumerate(files):
        torch.save(tensors, folder / f"consolidated.{rank:02d}.pth")
    params = {"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv_heads, "vocab_size": -1,
              "multiple_of": multiple_of, "ffn_dim_multiplier": multiplier, "norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_seq_len": 128}
    expected = transformers_conversion(files, heads, kv_heads, 0)
    ids = torch.tensor([[1, 7, 30, 2, 47, 11], [5, 5, 9, 40, 3, 0]])
    save_file({"input_ids": ids}, tmp_path / "in.safetensors")
    rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 4}

    def run(params, arch=""):
        (folder / "params.json").write_text(json.dumps(params))
        config = tmp_path / "llama.toml"
        config.write_text(f'checkpoint = "{folder}"\nconverter = "{CONVERTERS / "meta_llama.lua"}"\n{arch}')
        return vramctl("run", config, "--input", tmp_path / "in.safetensors", "--output", tmp_path / "out.safetensors")

    def transformers_logits(**extra):
        hf_config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden,
                                             num_hidden_layers=layers, num_attention_heads=heads,
                                             num_key_value_heads=kv_heads, rms_norm_eps=1e-5, rope_theta=500000.0,
                                             tie_word_embeddings=False, **extra)
        model = transformers.LlamaForCausalLM(hf_config).eval()
        model.load_state_dict(expected, strict=True)
        with torch.no_grad():
            return model(input_ids=ids).logits

    def assert_close(got, logits):
        assert ((got - logits).abs().max() / logits.abs().max()).item() <= 1e-5

    result = run(params)
    assert result.returncode == 0, result.stderr
    plain = transformers_logits()
    assert_close(load_file(tmp_path / "out.safetensors")["logits"], plain)

    # Llama 3.1's scaled rope: params.json does not say the factor, so [arch] must.
    result = run(params | {"use_scaled_rope": True})
    assert result.returncode != 0
    assert f"{folder}/params.json: use_scaled_rope is set" in result.stderr and "rope_scaling in [arch]" in result.stderr
    arch = "[arch.rope_scaling]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in rope_scaling.items())
    result = run(params | {"use_scaled_rope": True}, arch)
    assert result.returncode == 0, result.stderr
    scaled = transformers_logits(rope_scaling=rope_scaling, max_position_embeddings=128)
    assert (scaled - plain).abs().max() > 1e-3  # the scaling changes this model's logits
    assert_close(load_file(tmp_path / "out.safetensors")["logits"], scaled)

    # A key vramd does not read may change the model: refused, naming it.
    result = run(params | {"moe": {"num_experts": 8}})
    assert result.returncode != 0
    assert f"{folder}/params.json: the key 'moe' is not one vramd reads" in result.stderr


def test_meta_shards_without_a_converter_are_refused_naming_the_way_to_join_them(tmp_path):
    files = meta_split(meta_checkpoint(16, 2, 2, 1, 24, 8), 2, 1)
    for rank, tensors in enumerate(files):
        torch.save(tensors, tmp_path / f"consolidated.{rank:02d}.pth")
    result = vramctl("inspect", tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    shards = json.loads(result.stdout)["tensors"]["layers.0.attention.wq.weight"]["shards"]
    assert [(Path(s["file"]).name, s["shape"]) for s in shards] == \
        [("consolidated.00.pth", [8, 16]), ("consolidated.01.pth", [8, 16])]
    config = tmp_path / "plain.toml"
    config.write_text(f'checkpoint = "{tmp_path}"\narchitecture = "weights"\n')
    result = vramctl("check", config)
    assert result.returncode != 0
    assert f"{tmp_path}/consolidated.01.pth: holds the key 'layers.0.attention.wk.weight', which " \
           f"{tmp_path}/consolidated.00.pth holds too; when each file holds a slice of every tensor" in result.stdout + result.stderr
