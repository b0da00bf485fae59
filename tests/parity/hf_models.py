"""Small randomly initialised Hugging Face models, saved with save_pretrained, with inputs and
the outputs transformers computes for them: the witnesses the model tests compare vramd with.

    python tests/parity/hf_models.py OUT_DIR [CASE ...]

writes OUT_DIR/CASE-DTYPE/model/ (as save_pretrained writes it) and OUT_DIR/CASE-DTYPE/{inputs,expected}.safetensors.
"""
import sys
from pathlib import Path

import torch
import transformers as T
from safetensors.torch import save_file

VOCAB = 1000

# name -> (config, the model class that saves it)
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
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def inputs_for(config_class_name):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # the second sequence is right-padded
    inputs = {"input_ids": ids, "attention_mask": mask}
    if config_class_name == "BertModel":
        inputs["token_type_ids"] = (torch.arange(12) >= 6).long().expand(2, 12).contiguous()
    return inputs


def outputs(model, inputs):
    """What vramd names its outputs, computed by transformers."""
    with torch.no_grad():
        output = model(**inputs)
        if type(model).__name__ == "BertModel":
            return {"last_hidden_state": output.last_hidden_state, "pooler_output": output.pooler_output}
        return {"logits": output.logits, "last_hidden_state": model.base_model(**inputs).last_hidden_state}


def make(case, dtype_name, out):
    config, model_class = CASES[case]()
    torch.manual_seed(0)
    model = model_class(config).to(DTYPES[dtype_name]).eval()
    # Hugging Face initialises with std 0.02; larger weights make differences visible.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    folder = Path(out) / f"{case}-{dtype_name}"
    model.save_pretrained(folder / "model", safe_serialization=True)
    # The witness is the model as users load it: from_pretrained keeps buffers such as LLaMA's
    # rotary frequencies in float32, which .to(bfloat16) above would round.
    model = model_class.from_pretrained(folder / "model", dtype=DTYPES[dtype_name]).eval()
    inputs = inputs_for(model_class.__name__)
    expected = outputs(model, inputs)
    save_file({k: v.contiguous() for k, v in inputs.items()}, folder / "inputs.safetensors")
    save_file({k: v.contiguous() for k, v in expected.items()}, folder / "expected.safetensors")
    return folder


if __name__ == "__main__":
    out, cases = sys.argv[1], sys.argv[2:] or list(CASES)
    for case in cases:
        for dtype_name in DTYPES:
            print(make(case, dtype_name, out))
