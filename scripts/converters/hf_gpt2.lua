-- Hugging Face GPT-2 -> Linear layout with separate q, k, v projections.
--
-- GPT-2 stores its projections as Conv1D weights, [in, out], with query, key and value fused
-- in one c_attn. This converter turns each into a Linear weight, [out, in], and splits c_attn
-- into q_proj, k_proj and v_proj. The attention-mask buffers of old checkpoints (attn.bias,
-- attn.masked_bias) are dropped. For a GPT2LMHeadModel checkpoint set prefix = "transformer."
-- in the model config.

local out = {}
local linear = { ["attn.c_proj"] = "attn.out_proj", ["mlp.c_fc"] = "mlp.fc_in", ["mlp.c_proj"] = "mlp.fc_out" }

for name, t in src:items() do
  local layer, rest = name:match("^h%.(%d+)%.(.+)$")
  if name == "wte.weight" then
    out["embed_tokens.weight"] = t
  elseif name == "wpe.weight" then
    out["embed_positions.weight"] = t
  elseif name:match("^ln_f%.") then
    out[name:gsub("^ln_f", "norm")] = t
  elseif layer then
    local p = "layers." .. layer .. "."
    local module, kind = rest:match("^(.+)%.(%a+)$")
    if module == "attn.c_attn" and kind == "weight" then
      local q, k, v = t:chunk(3, 1)
      out[p .. "attn.q_proj.weight"], out[p .. "attn.k_proj.weight"], out[p .. "attn.v_proj.weight"] = q:t(), k:t(), v:t()
    elseif module == "attn.c_attn" and kind == "bias" then
      local q, k, v = t:chunk(3, 0)
      out[p .. "attn.q_proj.bias"], out[p .. "attn.k_proj.bias"], out[p .. "attn.v_proj.bias"] = q, k, v
    elseif linear[module] then
      out[p .. linear[module] .. "." .. kind] = kind == "weight" and t:t() or t
    elseif module == "ln_1" or module == "ln_2" then
      out[p .. rest] = t
    end
  end
end
return out
