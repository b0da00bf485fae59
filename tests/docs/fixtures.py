"""What the docs take for granted, made small: the checkpoints a `/models/NAME/` in a block stands
for, and the files a marker's `given` names (docs/development.md, "Tests")."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _hf(model_class, config_class, **config):
    """A random transformers model saved with save_pretrained (transformers is imported once asked)."""
    def make(folder):
        import transformers
        transformers.logging.disable_progress_bar()
        torch.manual_seed(0)
        getattr(transformers, model_class)(getattr(transformers, config_class)(**config)).save_pretrained(folder)
    return make


def _nanogpt(folder):
    """The ckpt.pt nanoGPT's train.py writes for its Shakespeare quick start (6 layers of 384, 65
    characters, block 256, bias=False, compiled), random weights and an optimizer that has not
    stepped yet, to keep the file small."""
    torch.manual_seed(0)
    layers, width, vocab, block = 6, 384, 65, 256
    weights = {"transformer.wte.weight": torch.randn(vocab, width) * 0.02,
               "transformer.wpe.weight": torch.randn(block, width) * 0.02,
               "transformer.ln_f.weight": torch.ones(width)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        weights |= {p + "ln_1.weight": torch.ones(width), p + "ln_2.weight": torch.ones(width),
                    p + "attn.c_attn.weight": torch.randn(3 * width, width) * 0.02,
                    p + "attn.c_proj.weight": torch.randn(width, width) * 0.02,
                    p + "mlp.c_fc.weight": torch.randn(4 * width, width) * 0.02,
                    p + "mlp.c_proj.weight": torch.randn(width, 4 * width) * 0.02}
    weights["lm_head.weight"] = weights["transformer.wte.weight"]
    parameters = [torch.nn.Parameter(t) for t in weights.values()]
    torch.save({"model": {"_orig_mod." + k: v for k, v in weights.items()},
                "optimizer": torch.optim.AdamW(parameters).state_dict(),
                "model_args": {"n_layer": layers, "n_head": 6, "n_embd": width, "block_size": block, "bias": False,
                               "vocab_size": vocab, "dropout": 0.2},
                "iter_num": 0, "best_val_loss": torch.tensor(1e9), "config": {"dataset": "shakespeare_char"}},
               folder / "ckpt.pt")


def _meta_llama(folder):
    """Meta's original layout: one consolidated.00.pth beside params.json."""
    torch.manual_seed(0)
    dim, layers, vocab, hidden = 64, 2, 1000, 192  # hidden: 2/3 of 4 * dim, up to multiple_of
    weights = {"tok_embeddings.weight": torch.randn(vocab, dim), "norm.weight": torch.ones(dim),
               "output.weight": torch.randn(vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        weights |= {p + "attention.wq.weight": torch.randn(dim, dim), p + "attention.wk.weight": torch.randn(32, dim),
                    p + "attention.wv.weight": torch.randn(32, dim), p + "attention.wo.weight": torch.randn(dim, dim),
                    p + "feed_forward.w1.weight": torch.randn(hidden, dim),
                    p + "feed_forward.w2.weight": torch.randn(dim, hidden),
                    p + "feed_forward.w3.weight": torch.randn(hidden, dim),
                    p + "attention_norm.weight": torch.ones(dim), p + "ffn_norm.weight": torch.ones(dim)}
    torch.save(weights, folder / "consolidated.00.pth")
    (folder / "params.json").write_text(json.dumps({"dim": dim, "n_layers": layers, "n_heads": 4, "n_kv_heads": 2,
                                                    "vocab_size": vocab, "multiple_of": 32, "norm_eps": 1e-5}))


def _fused_qkv(folder):
    """Meta's names with q, k and v fused in one wqkv of 4096 + 1024 + 1024 rows, as the typical
    converter of scripts/converters/README.md splits them (8 columns: only the rows matter)."""
    save_file({"tok_embeddings.weight": torch.zeros(100, 8), "norm.weight": torch.ones(8),
               "output.weight": torch.zeros(100, 8), "layers.0.attention_norm.weight": torch.ones(8),
               "layers.0.ffn_norm.weight": torch.ones(8), "layers.0.attention.wqkv.weight": torch.zeros(6144, 8)},
              folder / "model.safetensors")


TINY_LLAMA = _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=1000, hidden_size=64, intermediate_size=160,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 tie_word_embeddings=False)

# /models/NAME/ in a block: how to make NAME.
CHECKPOINTS = {
    "tiny-llama": TINY_LLAMA,  # docs/models.md's `vramctl plan` output is this model's
    "llama-1b": TINY_LLAMA,
    "Qwen2-0.5B": _hf("Qwen2ForCausalLM", "Qwen2Config", vocab_size=1000, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    # the README's in.safetensors holds ids up to 7570
    "starcoder2-3b": _hf("Starcoder2ForCausalLM", "Starcoder2Config", vocab_size=8000, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0),
    "nanogpt": _nanogpt,
    "llama-2-7b": _meta_llama,
    "fused-qkv": _fused_qkv,
}


def _safetensors(path):
    save_file({"h.0.w": torch.zeros(4, 8), "h.0.b": torch.zeros(8, dtype=torch.bfloat16)}, path,
              metadata={"format": "pt"})


def _sharded(folder):
    folder.mkdir()
    index = {}
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {f"layers.{shard}.weight": torch.zeros(16, 16)}
        save_file(tensors, folder / name)
        index |= {key: name for key in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def _pipeline(path):
    save_file({"text_encoder.weight": torch.zeros(8, 16), "unet.conv.weight": torch.zeros(8, 4, 3, 3, dtype=torch.bfloat16)},
              path, metadata={"pipeline": "example"})


# `given FILE` in a marker: how to make FILE in the page's scratch folder (models: the checkpoints' folder).
GIVEN = {
    "in.safetensors": lambda path, models: save_file({"input_ids": torch.tensor([[101, 7570, 2024, 2017, 102]])}, path),
    "model.safetensors": lambda path, models: _safetensors(path),
    "sharded-model/": lambda path, models: _sharded(path),
    "pipeline.safetensors": lambda path, models: _pipeline(path),
    "pytorch_model.bin": lambda path, models: torch.save({"h.0.w": torch.zeros(4, 8)}, path),
    "configs/models/tiny-llama.toml":
        lambda path, models: path.write_text(f'checkpoint = "{checkpoint(models, "tiny-llama")}/"\n'),
}


def checkpoint(models: Path, name: str) -> Path:
    """The folder of checkpoint NAME under `models`, made the first time it is asked for."""
    folder = models / name
    if not folder.exists():
        if name not in CHECKPOINTS:
            raise AssertionError(f"a block names /models/{name}/, which tests/docs/fixtures.py does not make")
        folder.mkdir(parents=True)
        CHECKPOINTS[name](folder)
    return folder
