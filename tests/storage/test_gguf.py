"""GGUF files through vramctl inspect. The witness is the `gguf` package (llama.cpp's own Python
reader and writer) in this same run: what it writes, vramd indexes exactly as its reader does;
hostile files, forged byte by byte here, are refused in one line naming the file."""
import importlib.util
import json
import os
import re
import struct
import subprocess
import sys

from pathlib import Path

import gguf
import numpy as np
import pytest

VRAMCTL = os.environ["VRAMCTL"]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # vramd.toml names the shipped converters
QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def vramctl(*args):
    return subprocess.run([VRAMCTL, *map(str, args)], capture_output=True, text=True, timeout=120)


def inspect_json(path):
    result = vramctl("inspect", path, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def packed(qtype, rows, columns, rng):
    """A [rows, columns] tensor as the bytes of `qtype`: quantized by the gguf package where it
    can, else random blocks (the K types: their layout, not their values, is what is indexed)."""
    values = rng.standard_normal((rows, columns)).astype(np.float32)
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, (rows, columns // block * size), dtype=np.uint8)


@pytest.fixture(scope="module")
def witness(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("general.flag", True)
    writer.add_int64("general.big", -(1 << 40))
    writer.add_float64("general.precise", 0.125)
    writer.add_string("general.name", "tiny \u00e9")
    writer.add_array("general.short", [1, 2, 3])
    writer.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(1000)])
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 64)).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float16))
    writer.add_tensor("positions", np.arange(12, dtype=np.int32).reshape(3, 4))
    for qtype_name in QUANTIZED:
        qtype = gguf.GGMLQuantizationType[qtype_name]
        data = packed(qtype, 4, 512, rng)
        writer.add_tensor(f"blk.0.{qtype_name.lower()}.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_inspect_indexes_every_tensor_as_the_gguf_reader_does(witness):
    reader = gguf.GGUFReader(witness)
    doc = inspect_json(witness)
    assert doc["files"][0]["format"] == "gguf"
    assert len(doc["tensors"]) == len(reader.tensors) == 3 + len(QUANTIZED)
    for tensor in reader.tensors:
        ours = doc["tensors"][tensor.name]
        assert ours["dtype"] == tensor.tensor_type.name, tensor.name
        assert ours["shape"] == [int(n) for n in reversed(tensor.shape)], tensor.name  # ggml counts innermost first
        assert (ours["offset"], ours["nbytes"]) == (tensor.data_offset, tensor.n_bytes), tensor.name
    metadata = doc["files"][0]["metadata"]
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.block_count"] == 2 and metadata["llama.rope.freq_base"] == 10000.5
    assert metadata["general.flag"] is True and metadata["general.big"] == -(1 << 40)
    assert metadata["general.precise"] == 0.125 and metadata["general.name"] == "tiny \u00e9"
    assert metadata["general.short"] == [1, 2, 3]
    assert metadata["tokenizer.ggml.tokens"] == "[1000 strings]"  # long arrays are summarised
    assert set(metadata) == set(reader.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def test_the_text_view_names_each_tensor_type(witness):
    result = vramctl("inspect", witness)
    assert result.returncode == 0, result.stderr
    assert "gguf" in result.stdout and "llama.block_count = 2" in result.stdout
    for qtype_name in QUANTIZED:
        assert re.search(rf"blk\.0\.{qtype_name.lower()}\.weight +{qtype_name} ", result.stdout), qtype_name


def test_a_gguf_file_is_known_by_its_magic_not_its_name(witness, tmp_path):
    for name in ["model.safetensors", "weights.bin", "no_suffix"]:
        (tmp_path / name).write_bytes(witness.read_bytes())
        assert inspect_json(tmp_path / name)["files"][0]["format"] == "gguf"
        (tmp_path / name).unlink()
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "tiny-Q4_0.gguf").write_bytes(witness.read_bytes())
    assert inspect_json(folder)["files"][0]["path"] == str(folder / "tiny-Q4_0.gguf")


# --- Forged files ---------------------------------------------------------------------------------

def string(text):
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def kv(key, type_id, payload):
    return string(key) + struct.pack("<I", type_id) + payload


def info(name, dims, type_id, offset):
    return string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + \
        struct.pack("<IQ", type_id, offset)


def forge(kvs=(), infos=(), data=b"", version=3, counts=None, alignment=32):
    """A GGUF file from its parts, the data region at the next multiple of `alignment`."""
    tensors, keys = counts if counts else (len(infos), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", version, tensors, keys) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


F32 = 0
GOOD = forge(infos=[info("a", [4, 2], F32, 0), info("b", [8], F32, 32)], data=bytes(64))
HOSTILE = [
    ("empty", b"", "the file ends inside the header (0 bytes"),
    ("no magic", b"GGML" + bytes(60), "not a GGUF file"),
    ("cut in the magic", b"GG", "the file ends inside the header"),
    ("cut in the counts", GOOD[:12], "the file ends inside the header"),
    ("cut in a tensor info", GOOD[:40], "2 tensors and 0 metadata keys cannot fit in a header of at most 40 bytes"),
    ("cut in the one tensor info", forge(infos=[info("a", [4, 2], F32, 0)], data=bytes(32))[:40],
     "the file ends inside tensor 'a'"),
    ("cut in the data", GOOD[:-1], "tensor 'b' ends at byte"),
    ("version 1", forge(version=1), "GGUF version 1"),
    ("version 4", forge(version=4), "GGUF version 4 is not read"),
    ("big-endian", b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "a big-endian GGUF file (version 3)"),
    ("huge counts", forge(counts=(1 << 60, 0)), "cannot fit in a header"),
    ("huge string", forge([kv("k", 8, struct.pack("<Q", 1 << 62))]), "metadata key 'k' has a string of"),
    ("huge array", forge([kv("k", 9, struct.pack("<IQ", 10, 1 << 62))]), "more than a file holds"),
    ("unknown value type", forge([kv("k", 13, b"")]), "metadata key 'k' has an unknown value type 13"),
    ("nested array", forge([kv("k", 9, struct.pack("<IQ", 9, 1))]), "is an array of arrays"),
    ("bool of 2", forge([kv("k", 7, b"\x02")]), "metadata key 'k' is a bool holding 2"),
    ("key twice", forge([kv("k", 0, b"\x01"), kv("k", 0, b"\x01")]), "metadata key 'k' is given twice"),
    ("key not UTF-8", forge([kv(b"\xff", 0, b"\x01")]), "has a key that is not UTF-8"),
    ("alignment 3", forge([kv("general.alignment", 4, struct.pack("<I", 3))]), "is 3, not a power of two"),
    ("alignment a string", forge([kv("general.alignment", 8, string("x"))]), "must be a uint32, found string"),
    ("five dimensions", forge(infos=[info("t", [1] * 5, F32, 0)], data=bytes(32)), "tensor 't' has 5 dimensions"),
    ("unread type", forge(infos=[info("t", [256], 16, 0)], data=bytes(256)),
     "tensor 't' has ggml type 16 (IQ2_XXS), which vramd does not read"),
    ("unknown type", forge(infos=[info("t", [4], 99, 0)], data=bytes(32)), "tensor 't' has ggml type 99,"),
    ("rows not whole blocks", forge(infos=[info("t", [16, 2], 8, 0)], data=bytes(96)),
     "tensor 't' is Q8_0, in blocks of 32 elements, but its rows hold 16"),
    ("product overflows", forge(infos=[info("t", [1 << 40, 1 << 40], F32, 0)]), "whose product overflows"),
    ("misaligned offset", forge(infos=[info("t", [4], F32, 8)], data=bytes(64)), "not a multiple of the alignment 32"),
    ("overlap", forge(infos=[info("a", [16], F32, 0), info("b", [4], F32, 32)], data=bytes(64)),
     "tensors 'a' and 'b' overlap"),
    ("name twice", forge(infos=[info("t", [4], F32, 0), info("t", [4], F32, 32)], data=bytes(64)),
     "tensor 't' is given twice"),
    ("empty name", forge(infos=[info("", [4], F32, 0)], data=bytes(32)), "tensor 0 has an empty name"),
]


def test_a_forged_file_is_read_when_it_is_whole(tmp_path):
    (tmp_path / "good.gguf").write_bytes(GOOD)
    doc = inspect_json(tmp_path / "good.gguf")
    assert doc["tensors"]["a"]["shape"] == [2, 4] and doc["tensors"]["b"]["offset"] == len(GOOD) - 32
    reader = gguf.GGUFReader(tmp_path / "good.gguf")  # the forger agrees with the witness
    assert [t.name for t in reader.tensors] == ["a", "b"]


@pytest.mark.parametrize("name, data, message", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_a_hostile_file_is_refused_in_one_line(tmp_path, name, data, message):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    result = vramctl("inspect", path)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and str(path) in result.stderr and message in result.stderr, result.stderr


# --- Unpacking ------------------------------------------------------------------------------------

SCALE_OFFSETS = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype_name, rows, columns, rng, scale=2.0):
    """Random blocks of a K type whose float16 scales are finite (within +-scale): every bit
    pattern of the quants, and scales as a real file has them (gguf cannot quantize to these
    types)."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * columns // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype_name]:
        scales = rng.uniform(-scale, scale, len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def test_every_block_type_unpacks_to_the_gguf_packages_values_bit_for_bit(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "quantized.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for qtype_name in QUANTIZED:
        qtype = gguf.GGMLQuantizationType[qtype_name]
        data = (random_blocks(qtype_name, 6, 512, rng) if qtype_name in SCALE_OFFSETS
                else gguf.quants.quantize(rng.standard_normal((6, 512)).astype(np.float32) * 3, qtype))
        writer.add_tensor(qtype_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = tmp_path / "quantized.toml"
    config.write_text(f'checkpoint = "{path}"\nconverter = ""\n')  # the file's own names, not gguf.lua's
    result = vramctl("convert", config, "--output", tmp_path / "unpacked.safetensors")
    assert result.returncode == 0, result.stderr
    from safetensors.numpy import load_file
    ours = load_file(tmp_path / "unpacked.safetensors")
    for tensor in gguf.GGUFReader(path).tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        assert ours[tensor.name].dtype == np.float32 and ours[tensor.name].shape == expected.shape, tensor.name
        assert np.array_equal(ours[tensor.name].view(np.uint32), expected.view(np.uint32)), tensor.name


# --- Running a GGUF model -------------------------------------------------------------------------

def llama_gguf(path, model, quantize_to=None, extra=None, experts_to=None):
    """A transformers LlamaForCausalLM (or Qwen2, Qwen3, Phi-3, Gemma 2 or Gemma 3, or the
    mixtures Mixtral, Qwen2-MoE, Qwen3-MoE) written as llama.cpp's converter writes one: its
    names, LLaMA's (and Mixtral's) q and k rows of each head in Meta's rotary order, Gemma's
    norms plus one, the hyperparameters as metadata, each layer's experts stacked into 3-D
    ffn_*_exps; the 2-D weights quantized to `quantize_to` and the experts to `experts_to` where
    given. The gguf package cannot quantize to the K types: they are small random blocks instead
    of the model's values (a file for vramd against itself, not for transformers). Returns the
    experts' values as the file holds them, dequantized by the gguf package, under transformers'
    per-expert names."""
    rng = np.random.default_rng(3)
    c = model.config
    arch = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
            "qwen3_moe": "qwen3moe"}.get(c.model_type, c.model_type)  # olmoe is olmoe
    gemma = arch in ("gemma2", "gemma3")
    writer = gguf.GGUFWriter(path, arch)
    for key, value in [("context_length", c.max_position_embeddings), ("embedding_length", c.hidden_size),
                       ("feed_forward_length", c.intermediate_size), ("block_count", c.num_hidden_layers),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("vocab_size", c.vocab_size)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3's global layers' base
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", c.num_experts_per_tok)
        if arch not in ("llama", "olmoe"):  # theirs is feed_forward_length
            writer.add_uint32(f"{arch}.expert_feed_forward_length", c.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", c.shared_expert_intermediate_size)
    if arch in ("qwen3", "qwen3moe") or gemma:  # llama.cpp writes the head size where config.json has it
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    if gemma:
        writer.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    if arch == "gemma2":
        writer.add_float32(f"{arch}.attn_logit_softcapping", c.attn_logit_softcapping)
        writer.add_float32(f"{arch}.final_logit_softcapping", c.final_logit_softcapping)
    if arch == "phi3":  # and its tokens: transformers takes them from here, else Phi-3's 32000 and more
        writer.add_uint32(f"{arch}.attention.sliding_window", 2047)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    expert_names = {"ffn_gate_exps": ("w1", "gate_proj"), "ffn_up_exps": ("w3", "up_proj"),
                    "ffn_down_exps": ("w2", "down_proj")}
    held = {}
    if gemma:
        names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # the embedding's
        if ".mlp.experts." in name:  # transformers holds gate and up fused, [experts, 2 x rows, columns]
            if name.endswith("down_proj"):
                stacks = {"ffn_down_exps": tensor}
            else:
                gate, up = tensor.chunk(2, 1)
                stacks = {"ffn_gate_exps": gate, "ffn_up_exps": up}
            layer = name.split(".")[2]
            for target, stack in stacks.items():
                w = np.ascontiguousarray(stack.float().numpy())
                if experts_to:
                    data = (random_blocks(experts_to.name, w.shape[0] * w.shape[1], w.shape[2], rng, scale=1e-2)
                            .reshape(w.shape[0], w.shape[1], -1) if experts_to.name in SCALE_OFFSETS
                            else gguf.quants.quantize(w, experts_to))
                    writer.add_tensor(f"blk.{layer}.{target}.weight", data, raw_dtype=experts_to)
                    w = gguf.quants.dequantize(data, experts_to).astype(np.float32)
                else:
                    writer.add_tensor(f"blk.{layer}.{target}.weight", w)
                module, projection = ("block_sparse_moe", expert_names[target][0]) if c.model_type == "mixtral" \
                    else ("mlp", expert_names[target][1])
                for e in range(w.shape[0]):
                    held[f"model.layers.{layer}.{module}.experts.{e}.{projection}.weight"] = w[e]
            continue
        base, kind = name.removeprefix("model.").rsplit(".", 1)
        layer = base.split(".")[1] if base.startswith("layers.") else None
        part = base.split(".", 2)[2] if layer else base
        target = (f"blk.{layer}." if layer else "") + names[part] + "." + kind
        w = tensor.float().numpy()
        if gemma and name.endswith("norm.weight"):
            w = w + np.float32(1)
        if names[part] == "ffn_gate_inp_shexp":
            w = w.reshape(-1)  # a vector in llama.cpp's files
        heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(names[part])
        if heads and arch == "llama":
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        if quantize_to and w.ndim == 2:
            data = (random_blocks(quantize_to.name, *w.shape, rng, scale=1e-3) if quantize_to.name in SCALE_OFFSETS
                    else gguf.quants.quantize(w, quantize_to))
            writer.add_tensor(target, data, raw_dtype=quantize_to)
        else:
            writer.add_tensor(target, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def tiny(family, hidden_size=64, intermediate_size=128):
    import torch
    import transformers
    torch.manual_seed(0)
    shape = dict(vocab_size=1000, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    if family == "qwen3":  # head_dim 128, Qwen3's default, which transformers' GGUF loader keeps
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape)).eval()
        with torch.no_grad():  # q and k norms that are not ones, so that a lost one shows
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        return model
    if family == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**shape, pad_token_id=0)).eval()
    if family in ("gemma2", "gemma3"):  # tied, as every Gemma is: transformers reads no output.weight for them
        shape["tie_word_embeddings"] = True
        model = (transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**shape)) if family == "gemma2" else
                 transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**shape))).eval()
        with torch.no_grad():  # norms that are not zeros (1 + w: ones), so that a lost one shows
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.uniform_(-0.5, 0.5)
        return model
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape)).eval()
    with torch.no_grad():  # biases that are not zero, so that a lost one shows
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_()
    return model


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny("llama")


def tiny_moe(family):
    """A Mixtral, a Qwen2-MoE (with its shared expert), a Qwen3-MoE or an OLMoE of 4 experts, 2
    per token, whose experts' rows are one K-type block (256) long."""
    import torch
    import transformers
    torch.manual_seed(0)
    shape = dict(vocab_size=1000, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=2)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**shape, num_local_experts=4)).eval()
    if family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**shape, num_experts=4, moe_intermediate_size=256,
                                             shared_expert_intermediate_size=256)
        return transformers.Qwen2MoeForCausalLM(config).eval()
    if family == "olmoe":  # q and k normed over whole projections: norms that are not ones, so that a lost one shows
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**shape, num_experts=4)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        return model
    config = transformers.Qwen3MoeConfig(**shape, num_experts=4, moe_intermediate_size=256, head_dim=64,
                                         norm_topk_prob=True)
    return transformers.Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_gguf_mixture_of_experts_equals_its_values_from_safetensors(tmp_path, family, qtype):
    # llama.cpp's 3-D ffn_*_exps, its router and shared expert names and its expert counts:
    # the model equals the same weights saved by transformers with its experts' values replaced
    # by what the file holds, dequantized by the gguf package (to float32's last bits: the same
    # values at other addresses can take another path through MKL's matrix products); and
    # streamed under a limit with the experts' blocks packed, it equals itself resident.
    import torch
    from safetensors.torch import load_file, save_file
    model = tiny_moe(family)
    held = llama_gguf(tmp_path / "moe.gguf", model, experts_to=gguf.GGMLQuantizationType[qtype])
    model.config.rms_norm_eps = float(np.float32(model.config.rms_norm_eps))  # as the file holds it
    model.save_pretrained(tmp_path / "witness")
    weights = load_file(tmp_path / "witness" / "model.safetensors")
    assert held.keys() <= weights.keys() and len(held) == 2 * 4 * 3
    weights.update({name: torch.from_numpy(values) for name, values in held.items()})
    save_file(weights, tmp_path / "witness" / "model.safetensors", metadata={"format": "pt"})
    save_file({"input_ids": torch.tensor([[1, 5, 9, 200, 31, 7]])}, tmp_path / "inputs.safetensors")
    inputs, config = tmp_path / "inputs.safetensors", tmp_path / "vramd.toml"
    config.write_text(f'converters = ["{CONFIGS.parent / "scripts" / "converters"}"]\n[budgets]\ncpu = "1GiB"\n')
    expected, _ = run_gguf(tmp_path, "witness", tmp_path / "witness", "", inputs, config)
    resident, _ = run_gguf(tmp_path, "resident", "moe.gguf", "", inputs, config)
    error = ((resident["logits"] - expected["logits"]).abs().max() / expected["logits"].abs().max()).item()
    assert error <= 1e-6, error
    streamed, stats = run_gguf(tmp_path, "streamed", "moe.gguf", STREAMED.replace("400KiB", "1800KiB"), inputs, config)
    assert torch.equal(streamed["logits"], resident["logits"])
    v = stats["vram"]
    assert v["peak"] <= v["limit"] and v["experts"]["misses"] > 0 and 0 < v["bytes_packed"] <= v["bytes_streamed"], v


@pytest.mark.parametrize("family, qtype", [("llama", None), ("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q5_0"),
                                           ("qwen3", "Q8_0"), ("phi3", "Q4_1"), ("gemma2", "Q8_0"),
                                           ("gemma3", "Q4_1")])
def test_a_gguf_model_runs_from_one_line_as_transformers_reads_it(tmp_path, family, qtype):
    # The witness is transformers' own GGUF loader (gguf_file=), which dequantizes to float32.
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    path = tmp_path / "tiny.gguf"
    llama_gguf(path, tiny(family), gguf.GGMLQuantizationType[qtype] if qtype else None)
    witness = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf",
                                                                torch_dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200, 31, 7, 999, 4], [3, 8, 2, 44, 1, 0, 0, 0]])
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with torch.no_grad():
        expected = witness(input_ids=ids, attention_mask=mask).logits
    save_file({"input_ids": ids, "attention_mask": mask}, tmp_path / "inputs.safetensors")
    config = tmp_path / "tiny.toml"
    config.write_text('checkpoint = "tiny.gguf"\n')
    result = vramctl("run", config, "--daemon-config", CONFIGS / "vramd.toml", "--input", tmp_path / "inputs.safetensors",
                     "--output", tmp_path / "out.safetensors")
    assert result.returncode == 0, result.stderr
    logits = load_file(tmp_path / "out.safetensors")["logits"]
    keep = mask.bool()
    error = ((logits - expected)[keep].abs().max() / expected[keep].abs().max()).item()
    assert error <= 1e-5, error


def test_a_gguf_key_vramd_cannot_honour_is_refused(tiny_llama, tmp_path):
    llama_gguf(tmp_path / "scaled.gguf", tiny_llama, extra={"llama.rope.scaling.type": "yarn"})
    config = tmp_path / "scaled.toml"
    config.write_text('checkpoint = "scaled.gguf"\n')
    result = vramctl("run", config, "--daemon-config", CONFIGS / "vramd.toml")
    assert result.returncode == 1
    assert (f"{tmp_path / 'scaled.gguf'}: GGUF key 'llama.rope.scaling.type' is not read by vramd" in result.stderr
            ), result.stderr
    # A key read with a value of another type is refused naming it, as a missing one is.
    llama_gguf(tmp_path / "typed.gguf", tiny_llama, extra={"llama.attention.key_length": "16"})
    config.write_text('checkpoint = "typed.gguf"\n')
    result = vramctl("run", config, "--daemon-config", CONFIGS / "vramd.toml")
    assert result.returncode == 1
    assert result.stderr == (f"vramctl run: {tmp_path / 'typed.gguf'}: GGUF key 'llama.attention.key_length' is "
                             '"16", not a positive head size\n')


# --- GGUF blocks kept packed ------------------------------------------------------------------------

def run_gguf(tmp_path, name, checkpoint, extra, inputs, device_config=CONFIGS / "vramd.toml"):
    """vramctl run of `checkpoint` with `extra` config lines: its outputs and its stats."""
    from safetensors.torch import load_file
    config = tmp_path / f"{name}.toml"
    config.write_text(f'checkpoint = "{checkpoint}"\n{extra}')
    result = vramctl("run", config, "--daemon-config", device_config, "--input", inputs, "--output",
                     tmp_path / f"{name}.safetensors", "--stats-json", tmp_path / f"{name}.json", "--repeat", "2")
    assert result.returncode == 0, result.stderr
    return load_file(tmp_path / f"{name}.safetensors"), json.loads((tmp_path / f"{name}.json").read_text())


# A family of one embedding and nothing else (a user's family file, docs/architectures.md): its
# outputs are the rows of its weight as the op gets them, so they show the values unpacked
# right before the op, bit for bit.
ROWS_FAMILY = """summary = "an embedding alone: its outputs are its weight's rows"
model_types = ["llama"]
[hyperparameters]
hidden_size = "hidden_size"
num_heads = "num_attention_heads"
vocab_size = "vocab_size"
[switches]
num_layers = 0
positions = "none"
[names]
embed_tokens = "token_embd"
layer = "blk.{i}"
"""


def packed_rows(tmp_path, device):
    """For every block type, the rows of a [6, 512] tensor of random blocks kept packed and unpacked
    on `device` right before the op, against the gguf package's dequantize."""
    from safetensors.torch import save_file
    import torch
    rng = np.random.default_rng(2)
    (tmp_path / "rows.toml").write_text(ROWS_FAMILY)
    save_file({"input_ids": torch.arange(6).view(1, 6)}, tmp_path / "inputs.safetensors")
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "1GiB"\n"cuda:0" = "1GiB"\n')
    for qtype_name in QUANTIZED:
        qtype = gguf.GGMLQuantizationType[qtype_name]
        data = (random_blocks(qtype_name, 6, 512, rng) if qtype_name in SCALE_OFFSETS
                else gguf.quants.quantize(rng.standard_normal((6, 512)).astype(np.float32) * 3, qtype))
        path = tmp_path / f"{qtype_name}.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        for key, value in [("embedding_length", 512), ("block_count", 1), ("attention.head_count", 1)]:
            writer.add_uint32(f"llama.{key}", value)
        writer.add_tensor("token_embd.weight", data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        stored = gguf.GGUFReader(path).tensors[0]
        expected = gguf.quants.dequantize(stored.data, qtype).astype(np.float32)
        outputs, stats = run_gguf(tmp_path, qtype_name, path.name,
                                  f'architecture = "rows.toml"\nconverter = ""\n[vram]\npreparing = {{ packed = true }}\n'
                                  f'computation = {{ device = "{device}" }}\n', tmp_path / "inputs.safetensors",
                                  tmp_path / "vramd.toml")
        assert stats["vram"]["packed"] == stored.n_bytes, stats["vram"]
        rows = outputs["last_hidden_state"][0].numpy()
        assert rows.dtype == np.float32 and np.array_equal(rows.view(np.uint32), expected.view(np.uint32)), qtype_name


def test_every_block_type_kept_packed_unpacks_to_the_gguf_packages_values_bit_for_bit(tmp_path):
    packed_rows(tmp_path, "cpu")


def cuda_available():
    import torch
    return torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="no CUDA GPU here: GGUF blocks unpacked on CUDA are not run")
def test_every_block_type_kept_packed_unpacks_on_cuda_to_the_gguf_packages_values(tmp_path):
    packed_rows(tmp_path, "cuda:0")


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(),
                    reason="no CUDA GPU here: GGUF blocks staged packed to CUDA and unpacked there are not run")
@pytest.mark.parametrize("onload", ["disk", "cpu"])
def test_a_gguf_model_streamed_packed_on_cuda_gives_the_resident_outputs_on_cuda(tiny_llama, tmp_path, onload):
    # From disk the packed bytes go through the pinned staging buffers; from cpu they rest pinned,
    # packed. Either way they are unpacked on the GPU: the logits of the model resident there.
    import torch
    from safetensors.torch import save_file
    llama_gguf(tmp_path / "tiny.gguf", tiny_llama, gguf.GGMLQuantizationType.Q8_0)
    save_file({"input_ids": torch.tensor([[1, 5, 9, 200, 31]])}, tmp_path / "inputs.safetensors")
    (tmp_path / "vramd.toml").write_text(f'converters = ["{CONFIGS.parent / "scripts" / "converters"}"]\n'
                                         '[budgets]\ncpu = "1GiB"\n"cuda:0" = "1GiB"\n')
    cuda = '[vram]\ncomputation = { device = "cuda:0" }\n'
    inputs, daemon_config = tmp_path / "inputs.safetensors", tmp_path / "vramd.toml"
    resident, _ = run_gguf(tmp_path, "resident", "tiny.gguf", cuda, inputs, daemon_config)
    streamed, stats = run_gguf(tmp_path, "streamed", "tiny.gguf",
                               cuda + f'offload = {{ device = "cpu" }}\nonload = {{ device = "{onload}" }}\n'
                               'limit = "400KiB"\n' + ('onload_limit = "200KiB"\n' if onload == "cpu" else ""),
                               inputs, daemon_config)
    assert torch.equal(streamed["logits"], resident["logits"])
    v = stats["vram"]
    assert v["loads"] > 0 and 0 < v["bytes_packed"] <= v["bytes_streamed"] and v["peak"] <= v["limit"], v


STREAMED = '[vram]\noffload = { device = "disk" }\nonload = { device = "disk" }\nlimit = "400KiB"\n'


# Limits that hold the largest layer packed with its float32 copy, and not the whole model so.
@pytest.mark.parametrize("family, qtype, limit", [("llama", "Q8_0", "400KiB"), ("llama", "Q4_K", "1400KiB"),
                                                  ("qwen2", "Q5_0", "320KiB"), ("phi3", "Q4_1", "320KiB")])
def test_a_gguf_model_streamed_under_a_limit_moves_packed_bytes_and_gives_the_resident_outputs(tmp_path, family,
                                                                                               qtype, limit):
    # Under a limit, GGUF blocks stay packed by default (llama's q and k rows reordered packed by
    # gguf.lua); packed = false streams them unpacked, as before. All three: the resident logits.
    import torch
    from safetensors.torch import save_file
    k_type = qtype in SCALE_OFFSETS  # 256-element blocks: rows of 256
    model = tiny(family, hidden_size=256, intermediate_size=512) if k_type else tiny(family)
    llama_gguf(tmp_path / "tiny.gguf", model, gguf.GGMLQuantizationType[qtype])
    save_file({"input_ids": torch.tensor([[1, 5, 9, 200, 31]])}, tmp_path / "inputs.safetensors")
    streamed = STREAMED.replace("400KiB", limit)
    inputs = tmp_path / "inputs.safetensors"
    resident, _ = run_gguf(tmp_path, "resident", "tiny.gguf", "", inputs)
    packed, packed_stats = run_gguf(tmp_path, "packed", "tiny.gguf", streamed, inputs)
    unpacked, unpacked_stats = run_gguf(tmp_path, "unpacked", "tiny.gguf", streamed + "preparing = { packed = false }\n",
                                        inputs)
    host, host_stats = run_gguf(tmp_path, "host", "tiny.gguf",
                                streamed.replace('onload = { device = "disk" }', 'onload = { device = "cpu" }') +
                                'onload_limit = "200KiB"\n', inputs)
    for outputs in (packed, unpacked, host):
        assert torch.equal(outputs["logits"], resident["logits"])
    p, u, h = packed_stats["vram"], unpacked_stats["vram"], host_stats["vram"]
    assert p["loads"] > 0 and 0 < p["bytes_packed"] <= p["bytes_streamed"] and p["peak"] <= p["limit"], p
    assert p["packed"] > 0 and "GGUF blocks packed" in p["plan"], p
    assert u["loads"] > 0 and u["bytes_packed"] == 0 and u["packed"] == 0, u
    assert h["loads"] > 0 and 0 < h["bytes_packed"] <= h["bytes_streamed"] and "streamed from cpu" in h["plan"], h
    # Packed, the same limit keeps more of the model resident, and the same forwards stream a
    # fraction of the bytes (mapped from the page cache, as stored: no copy at all).
    assert p["resident"] / p["total"] > u["resident"] / u["total"], (p, u)
    assert p["bytes_streamed"] < u["bytes_streamed"] / 3 and p["bytes_mapped"] == p["bytes_packed"], (p, u)


def test_packed_true_on_a_checkpoint_without_gguf_blocks_is_an_error_naming_it(tiny_llama, tmp_path):
    llama_gguf(tmp_path / "f32.gguf", tiny_llama)  # F32 throughout: nothing to keep packed
    config = tmp_path / "f32.toml"
    config.write_text('checkpoint = "f32.gguf"\n[vram]\npreparing = { packed = true }\n')
    result = vramctl("check", config, "--daemon-config", CONFIGS / "vramd.toml")
    assert result.returncode == 1
    assert (f"{config}:3:15: vram.preparing.packed = true, but no weight of {tmp_path / 'f32.gguf'} can stay packed: it holds "
            "no GGUF block-quantized tensor (Q4_0 ... Q6_K); remove packed = true") in result.stdout, result.stdout


def test_the_daemon_streams_and_sleeps_a_gguf_model_packed_and_says_so(tiny_llama, tmp_path):
    # Asleep in host memory, the packed model holds its GGUF blocks as they are stored: a fraction
    # of what the same model holds unpacked. Awake, both give the resident logits.
    import torch
    from safetensors.torch import load, save
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
    from daemon_support import Daemon, model, request
    llama_gguf(tmp_path / "tiny.gguf", tiny_llama, gguf.GGMLQuantizationType.Q8_0)
    d = Daemon(tmp_path, extra=f'converters = ["{CONFIGS.parent / "scripts" / "converters"}"]')
    vram = '[vram]\noffload = { device = "cpu" }\nonload = { device = "disk" }\nlimit = "400KiB"\n'
    for name, extra in [("resident", ""), ("packed", vram), ("unpacked", vram + "preparing = { packed = false }\n")]:
        (d.models / f"{name}.toml").write_text(f'checkpoint = "{tmp_path / "tiny.gguf"}"\n{extra}')
    inputs = save({"input_ids": torch.tensor([[1, 5, 9, 200, 31]])})

    def forward(name):
        status, body = request(d.sock, "POST", f"/v1/models/{name}/forward", inputs)
        assert status == 200, body
        return load(body)["logits"]

    with d.start():
        expected = forward("resident")
        moved = {}
        for name in ("packed", "unpacked"):
            assert torch.equal(forward(name), expected), name
            status, body = request(d.sock, "POST", f"/v1/models/{name}/offload")
            assert status == 200, body
            slept = json.loads(body)
            assert slept["state"] == "offloaded", slept
            moved[name] = slept["moved"]["bytes"]
            assert torch.equal(forward(name), expected), name  # woken by the forward
        packed, unpacked = model(d.sock, "packed"), model(d.sock, "unpacked")
        assert packed["vram"]["preparing"]["packed"] == "auto" and unpacked["vram"]["offload"]["packed"] is False
        assert "computation" in packed["vram"] and "packed" not in packed["vram"]["computation"]
        w = packed["weights"]
        assert w["packed"] > 0 and 0 < w["bytes_packed"] <= w["bytes_streamed"] and "GGUF blocks packed" in w["plan"], w
        assert unpacked["weights"]["bytes_packed"] == 0 and unpacked["weights"]["packed"] == 0
        assert 0 < moved["packed"] < moved["unpacked"] / 3, moved
        assert d.stop() == 0


# --- LoRA adapters on GGUF weights ----------------------------------------------------------------

@pytest.mark.parametrize("vram", ["", STREAMED], ids=["resident", "streamed packed"])
def test_a_peft_adapter_on_a_gguf_model_equals_peft_on_transformers_gguf_loading(tmp_path, vram):
    """A peft adapter made on the model transformers' own GGUF loader reads (Hugging Face names),
    applied by [[lora]] to the Q8_0 file through gguf.lua: equal to peft's merge_and_unload() on
    that model. Under a limit the weights it changes are unpacked and adapted, the others stay
    packed."""
    import peft
    import torch
    import transformers
    from safetensors.torch import save_file
    llama_gguf(tmp_path / "tiny.gguf", tiny("llama"), gguf.GGMLQuantizationType.Q8_0)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf",
                                                              torch_dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200, 31, 7, 999, 4]])
    with torch.no_grad():
        base = model(input_ids=ids).logits  # before peft wraps the model's layers in place
    torch.manual_seed(2)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj"],
                                                         init_lora_weights=False))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.3)
    adapted.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        expected = adapted.merge_and_unload().eval()(input_ids=ids).logits
    save_file({"input_ids": ids}, tmp_path / "inputs.safetensors")
    outputs, stats = run_gguf(tmp_path, "lora", "tiny.gguf", f'[[lora]]\npath = "adapter"\n{vram}',
                              tmp_path / "inputs.safetensors")
    logits = outputs["logits"]
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error <= 1e-5, error
    assert ((logits - base).abs().max() / base.abs().max()).item() > 1e-2  # the adapter, applied
    if vram:
        v = stats["vram"]
        assert v["packed"] > 0 and v["bytes_packed"] > 0, v  # what no adapter changes stays packed
