"""Small randomly initialised Hugging Face models, saved with save_pretrained, with inputs and
the outputs transformers computes for them: the witnesses the model tests compare vramd with.

    python tests/parity/hf_models.py OUT_DIR [CASE ...]

writes OUT_DIR/CASE-DTYPE/model/ (as save_pretrained writes it) and OUT_DIR/CASE-DTYPE/{inputs,expected}.safetensors.
"""
import os
import shutil
import sys
from pathlib import Path

import torch
import transformers as T
from safetensors.torch import save_file

VOCAB = 1000

# name -> (config, the model class that saves it[, keyword arguments of that class])
CASES = {
    "llama": lambda: (T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
                      T.LlamaForCausalLM),
    # Tied embeddings, bias on every projection, LLaMA 3.1's rope scaling, multi-query attention.
    "llama3": lambda: (T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                     tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32}),
                       T.LlamaForCausalLM),
    "llama_linear_rope": lambda: (T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=1, num_attention_heads=4,
                                                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                 "factor": 4.0}),
                                  T.LlamaForCausalLM),
    # A window shorter than the inputs, so that it matters.
    "mistral": lambda: (T.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
                                        max_position_embeddings=256),
                        T.MistralForCausalLM),
    "qwen2": lambda: (T.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
                      T.Qwen2ForCausalLM),
    "gpt2": lambda: (T.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4),
                     T.GPT2LMHeadModel),
    "bert": lambda: (T.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64),
                     T.BertModel),
    # Families as files (configs/architectures/): each switch a family sets is exercised.
    # Layers 1 and 2 in a window shorter than the inputs (from max_window_layers on).
    "qwen2_sliding": lambda: (T.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                            use_sliding_window=True, sliding_window=5, max_window_layers=1),
                              T.Qwen2ForCausalLM),
    # Per-head q and k norms, a head_dim that is not hidden_size / heads, YaRN rotary scaling.
    "qwen3": lambda: (T.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                    max_position_embeddings=256,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 64}),
                      T.Qwen3ForCausalLM),
    # (1 + w) norms, embeddings scaled by sqrt(hidden_size), a tied head.
    "gemma": lambda: (T.GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=16),
                      T.GemmaForCausalLM),
    # Norms around each sublayer, soft-capped scores and logits, alternating sliding layers.
    "gemma2": lambda: (T.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                                      query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                      final_logit_softcapping=3.0),
                       T.Gemma2ForCausalLM),
    # Per-head (1 + w) q and k norms, a rotary base per layer type.
    "gemma3": lambda: (T.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, sliding_window=5, sliding_window_pattern=2,
                                          query_pre_attn_scalar=16),
                       T.Gemma3ForCausalLM),
    # Fused qkv and gate_up projections, half the dimensions rotating, LongRoPE past the original
    # context (the inputs' 12 tokens exceed 8, so the long factors apply).
    "phi3": lambda: (T.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                  original_max_position_embeddings=8, partial_rotary_factor=0.5, pad_token_id=0,
                                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                   "short_factor": [1.0, 1.5, 2.0, 2.5],
                                                   "long_factor": [3.0, 5.0, 7.0, 9.0]}),
                     T.Phi3ForCausalLM),
    # Norms after each sublayer, q and k norms over whole projections, rotation in float32.
    "olmo2": lambda: (T.Olmo2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, pad_token_id=1),
                      T.Olmo2ForCausalLM),
    # Mixtures of experts (saved with per-expert keys, as on the Hub). Mixtral: 2 of 4 experts,
    # renormalised weights kept in float32, a window shorter than the inputs.
    "mixtral": lambda: (T.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=5, max_position_embeddings=256),
                        T.MixtralForCausalLM),
    # 16 experts a layer, for the streaming tests (tests/parity/test_moe.py): a few tokens route to
    # a few of them.
    "mixtral_wide": lambda: (T.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=16, num_experts_per_tok=2,
                                             max_position_embeddings=256),
                             T.MixtralForCausalLM),
    # A shared expert behind its sigmoid gate, a dense layer among sparse ones (mlp_only_layers),
    # weights not renormalised.
    "qwen2_moe": lambda: (T.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                           moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                           num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                           mlp_only_layers=[1], max_position_embeddings=256),
                          T.Qwen2MoeForCausalLM),
    # Renormalised weights, every second layer sparse (decoder_sparse_step), a sliding window.
    "qwen3_moe": lambda: (T.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                           moe_intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, num_experts=8,
                                           num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                                           use_sliding_window=True, sliding_window=5, max_position_embeddings=256),
                          T.Qwen3MoeForCausalLM),
    # q and k norms over whole projections, q, k and v clamped.
    "olmoe": lambda: (T.OlmoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                    num_experts_per_tok=3, clip_qkv=0.7, pad_token_id=1, eos_token_id=2,
                                    max_position_embeddings=256),
                      T.OlmoeForCausalLM),
    # A BERT saved without its pooler (add_pooling_layer=False).
    "bert_no_pooler": lambda: (T.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128,
                                            max_position_embeddings=64),
                               T.BertModel, {"add_pooling_layer": False}),
    # Positions counted from pad_token_id + 1 over the tokens that are not padding.
    "roberta": lambda: (T.RobertaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=66, type_vocab_size=1,
                                        layer_norm_eps=1e-5),
                        T.RobertaModel),
    "xlm_roberta": lambda: (T.XLMRobertaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=128,
                                               max_position_embeddings=66, type_vocab_size=1),
                            T.XLMRobertaModel),
    # Causal pre-LayerNorm blocks, quick_gelu, the end-of-text token's state through a projection.
    "clip_text": lambda: (T.CLIPTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                                           projection_dim=48, eos_token_id=VOCAB - 1, bos_token_id=VOCAB - 2),
                          T.CLIPTextModelWithProjection),
    # CLIPTextModel saves its names without "text_model."; the legacy eos_token_id 2 pools at the
    # largest id.
    "clip_text_plain": lambda: (T.CLIPTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 max_position_embeddings=32, eos_token_id=2, hidden_act="gelu"),
                                T.CLIPTextModel),
    # Relative position buckets, unscaled attention, no biases; v1.1's gated GELU and v1.0's ReLU.
    "t5_encoder": lambda: (T.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                      relative_attention_num_buckets=8, relative_attention_max_distance=10,
                                      feed_forward_proj="gated-gelu"),
                           T.T5EncoderModel),
    "t5_encoder_relu": lambda: (T.T5Config(vocab_size=VOCAB, d_model=64, d_kv=24, d_ff=128, num_layers=2,
                                           num_heads=4, feed_forward_proj="relu"),
                                T.T5EncoderModel),
}
# Encoders whose outputs are the hidden states and the pooled ones, not logits.
ENCODERS = ("BertModel", "RobertaModel", "XLMRobertaModel", "CLIPTextModel", "CLIPTextModelWithProjection",
            "T5EncoderModel")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# vramd's outputs against transformers': float32 to 1e-5 relative, bfloat16 to its own precision.
# The float32 outputs are equal bit for bit but for the mixtures of experts (within 6e-7): same
# LibTorch kernels, same op order. A first forward that raced MKL's vector math gave 2.6e-5 once in
# 50 processes, until vramd settled it before loading (docs/benchmarks.md).
TOLERANCE = {"float32": 1e-5, "bfloat16": 1.6e-2}


def close(got, expected, dtype="float32"):
    """Within the parity bound of `dtype`."""
    return relative_error(got, expected) <= TOLERANCE[dtype]


def relative_error(got, expected):
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()

# Under the sanitizers (CI's second run of the suite) every case runs the same C++ in both
# dtypes: bfloat16 is checked in the plain build only, which keeps CI's time.
SANITIZED = "ASAN_OPTIONS" in os.environ
DTYPES_THIS_RUN = ["float32"] if SANITIZED else list(DTYPES)
SKIP_UNDER_SANITIZERS = "bfloat16 runs in the plain build; under the sanitizers float32 covers the same C++"


def inputs_for(model):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB - 2, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # the second sequence is right-padded
    if model.config.pad_token_id is not None:
        ids[1, 9:] = model.config.pad_token_id  # as a tokenizer pads (RoBERTa's positions count the rest)
    if model.config.model_type == "clip_text_model":  # each row ends with end-of-text
        ids[0, 11] = ids[1, 8] = model.config.eos_token_id if model.config.eos_token_id != 2 else VOCAB - 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    if type(model).__name__ == "BertModel":
        inputs["token_type_ids"] = (torch.arange(12) >= 6).long().expand(2, 12).contiguous()
    return inputs


def outputs(model, inputs):
    """What vramd names its outputs, computed by transformers."""
    with torch.no_grad():
        output = model(**inputs)
        if type(model).__name__ in ENCODERS:
            return {name: getattr(output, name) for name in ("last_hidden_state", "pooler_output", "text_embeds")
                    if getattr(output, name, None) is not None}
        return {"logits": output.logits, "last_hidden_state": model.base_model(**inputs).last_hidden_state}


def make(case, dtype_name, out):
    config, model_class, *options = CASES[case]()
    options = options[0] if options else {}
    torch.manual_seed(0)
    model = model_class(config, **options).to(DTYPES[dtype_name]).eval()
    # Hugging Face initialises with std 0.02; larger weights make differences visible.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    folder = Path(out) / f"{case}-{dtype_name}"
    model.save_pretrained(folder / "model", safe_serialization=True)
    # The witness is the model as users load it: from_pretrained keeps buffers such as LLaMA's
    # rotary frequencies in float32, which .to(bfloat16) above would round.
    model = model_class.from_pretrained(folder / "model", dtype=DTYPES[dtype_name], **options).eval()
    inputs = inputs_for(model)
    expected = outputs(model, inputs)
    save_file({k: v.contiguous() for k, v in inputs.items()}, folder / "inputs.safetensors")
    save_file({k: v.contiguous() for k, v in expected.items()}, folder / "expected.safetensors")
    return folder


def save_beside(witness, state, folder):
    """`state` saved as a checkpoint of `witness`'s model (make()'s folder): its config.json
    copied beside it. Returns the checkpoint's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors")
    shutil.copy(Path(witness) / "model" / "config.json", folder / "config.json")
    return folder / "model.safetensors"


def perturbed(state, seed=1, scale=0.05):
    """Every tensor of `state` moved by seeded noise: the new values of an update."""
    generator = torch.Generator().manual_seed(seed)
    return {name: value + torch.randn(value.shape, generator=generator) * scale for name, value in state.items()}


if __name__ == "__main__":
    out, cases = sys.argv[1], sys.argv[2:] or list(CASES)
    for case in cases:
        for dtype_name in DTYPES:
            print(make(case, dtype_name, out))
