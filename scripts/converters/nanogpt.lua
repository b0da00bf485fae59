-- nanoGPT checkpoints -> Hugging Face GPT-2 names, which vramd's gpt2 architecture loads.
--
-- nanoGPT names its weights as GPT-2 does but keeps the four projections as nn.Linear, [out, in],
-- where GPT-2's Conv1D keeps [in, out]: those are transposed, everything else passes through.
-- lm_head.weight is tied to transformer.wte.weight, so the loader reads it once. A model saved
-- after torch.compile has every key under "_orig_mod.": set prefix = "_orig_mod." in the model
-- config. nanoGPT saves no config.json: give n_embd, n_head, n_layer, vocab_size and
-- n_positions in [arch].

local linear = { "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj" }

local out = {}
for name, t in src:items() do
  out[name] = t
  for _, module in ipairs(linear) do
    if name:sub(-#module - 7) == module .. ".weight" then out[name] = t:t() end
  end
end
return out
