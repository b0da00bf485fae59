-- nanoGPT checkpoints -> Hugging Face GPT-2 names, which vramd's gpt2 architecture loads.
--
-- nanoGPT names its weights as GPT-2 does but keeps the four projections as nn.Linear, [out, in],
-- where GPT-2's Conv1D keeps [in, out]: those are transposed, everything else passes through.
-- lm_head.weight is tied to transformer.wte.weight, so the loader reads it once.
--
-- The layouts it takes:
-- - a state dict saved alone; after torch.compile every key is under "_orig_mod.": set
--   prefix = "_orig_mod." in the model config;
-- - the ckpt.pt that train.py saves ({"model": ..., "optimizer": ..., "model_args": ...}):
--   prefix = "model." (or "model._orig_mod." when compiled); the rest of the file is left out.
--
-- nanoGPT saves no config.json: give n_embd, n_head, n_layer, vocab_size and n_positions
-- (nanoGPT's block_size) in [arch], from the checkpoint's model_args, and
-- activation_function = "gelu": nanoGPT's MLP uses exact GELU (nn.GELU()), where the gpt2 family
-- defaults to GPT-2's tanh approximation ("gelu_new"), 2.4e-4 apart.
--
-- A model trained with bias=False (train.py's default) saves no bias tensors at all, and GPT-2
-- without biases is GPT-2 with zero biases, which this script adds. It tells such a checkpoint
-- by that absence; bias = false or true in [arch] says it outright, and a checkpoint that
-- contradicts it is refused.

local linear = { "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj" }

local out = {}
for name, t in src:items() do
  out[name] = t
  for _, module in ipairs(linear) do
    if name:sub(-#module - 7) == module .. ".weight" then out[name] = t:t() end
  end
end

-- The causal mask nanoGPT registers as attn.bias where it lacks flash attention is no bias.
local saved_biases = false
for _, name in ipairs(src:keys()) do
  if name:sub(-5) == ".bias" and name:sub(-10) ~= ".attn.bias" then saved_biases = true end
end
local bias = arch.bias
if bias == nil then bias = saved_biases end
if bias == true and not saved_biases then
  error("bias = true in [arch], but the checkpoint has no bias tensors (a model trained with bias=False); "
        .. "set bias = false, or leave bias out")
end

if bias == false then
  local e, dtype = arch.n_embd, src["transformer.wte.weight"].dtype
  local sizes = { ["ln_1.bias"] = e, ["attn.c_attn.bias"] = 3 * e, ["attn.c_proj.bias"] = e, ["ln_2.bias"] = e,
                  ["mlp.c_fc.bias"] = arch.n_inner or 4 * e, ["mlp.c_proj.bias"] = e }
  local function zero(key, size)
    if src:has(key) then error("bias = false in [arch], but the checkpoint has " .. key .. "; leave bias out") end
    out[key] = zeros({ size }, dtype)
  end
  for i = 0, arch.n_layer - 1 do
    for suffix, size in pairs(sizes) do zero("transformer.h." .. i .. "." .. suffix, size) end
  end
  zero("transformer.ln_f.bias", e)
end
return out
