-- Diffusers' SD3Transformer2DModel -> the original Stable Diffusion 3 (MMDiT) layout.
--
-- Diffusers splits each attention's fused qkv into to_q, to_k, to_v and stores the final
-- adaLN modulations as (scale, shift) where the original has (shift, scale); this converter
-- concatenates and swaps them back. It covers SD3 and SD3.5 (qk norms, dual attention).

local function swap_halves(t)
  local first, second = t:chunk(2, 0)
  return cat({ second, first }, 0)
end

local last = -1
for _, name in ipairs(src:keys()) do
  local i = name:match("^transformer_blocks%.(%d+)%.")
  if i and tonumber(i) > last then last = tonumber(i) end
end

local top = {
  ["pos_embed.pos_embed"] = "pos_embed",
  ["pos_embed.proj.weight"] = "x_embedder.proj.weight", ["pos_embed.proj.bias"] = "x_embedder.proj.bias",
  ["time_text_embed.timestep_embedder.linear_1.weight"] = "t_embedder.mlp.0.weight",
  ["time_text_embed.timestep_embedder.linear_1.bias"] = "t_embedder.mlp.0.bias",
  ["time_text_embed.timestep_embedder.linear_2.weight"] = "t_embedder.mlp.2.weight",
  ["time_text_embed.timestep_embedder.linear_2.bias"] = "t_embedder.mlp.2.bias",
  ["time_text_embed.text_embedder.linear_1.weight"] = "y_embedder.mlp.0.weight",
  ["time_text_embed.text_embedder.linear_1.bias"] = "y_embedder.mlp.0.bias",
  ["time_text_embed.text_embedder.linear_2.weight"] = "y_embedder.mlp.2.weight",
  ["time_text_embed.text_embedder.linear_2.bias"] = "y_embedder.mlp.2.bias",
  ["context_embedder.weight"] = "context_embedder.weight", ["context_embedder.bias"] = "context_embedder.bias",
  ["proj_out.weight"] = "final_layer.linear.weight", ["proj_out.bias"] = "final_layer.linear.bias",
}
-- Block modules renamed as they are: diffusers name -> original name, within a block.
local renames = {
  ["attn.norm_q"] = "x_block.attn.ln_q", ["attn.norm_k"] = "x_block.attn.ln_k",
  ["attn.norm_added_q"] = "context_block.attn.ln_q", ["attn.norm_added_k"] = "context_block.attn.ln_k",
  ["attn.to_out.0"] = "x_block.attn.proj", ["attn.to_add_out"] = "context_block.attn.proj",
  ["attn2.norm_q"] = "x_block.attn2.ln_q", ["attn2.norm_k"] = "x_block.attn2.ln_k",
  ["attn2.to_out.0"] = "x_block.attn2.proj",
  ["norm1.linear"] = "x_block.adaLN_modulation.1",
  ["ff.net.0.proj"] = "x_block.mlp.fc1", ["ff.net.2"] = "x_block.mlp.fc2",
  ["ff_context.net.0.proj"] = "context_block.mlp.fc1", ["ff_context.net.2"] = "context_block.mlp.fc2",
}
-- Fused projections: original name -> the diffusers q, k, v modules, within a block.
local fused = {
  ["x_block.attn.qkv"] = { "attn.to_q", "attn.to_k", "attn.to_v" },
  ["context_block.attn.qkv"] = { "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj" },
  ["x_block.attn2.qkv"] = { "attn2.to_q", "attn2.to_k", "attn2.to_v" },
}

local out = {}
for name, t in src:items() do
  local i, module, kind = name:match("^transformer_blocks%.(%d+)%.(.+)%.(%a+)$")
  if top[name] then
    out[top[name]] = t
  elseif name == "norm_out.linear.weight" or name == "norm_out.linear.bias" then
    out["final_layer.adaLN_modulation.1." .. name:match("(%a+)$")] = swap_halves(t)
  elseif i and renames[module] then
    out["joint_blocks." .. i .. "." .. renames[module] .. "." .. kind] = t
  elseif i and module == "norm1_context.linear" then
    -- The last block's context stream only modulates (no attention output, no MLP); there
    -- diffusers swaps the halves too.
    local target = "joint_blocks." .. i .. ".context_block.adaLN_modulation.1." .. kind
    out[target] = tonumber(i) == last and swap_halves(t) or t
  elseif not (i and (module:match("^attn2?%.to_[qkv]$") or module:match("^attn%.add_[qkv]_proj$"))) then
    error("unexpected key '" .. name .. "' in a diffusers SD3 transformer")
  end  -- q, k and v parts are fused below
end
for i = 0, last do
  for original, parts in pairs(fused) do
    local p = "transformer_blocks." .. i .. "."
    for _, kind in ipairs({ "weight", "bias" }) do
      if src:has(p .. parts[1] .. "." .. kind) then
        local pieces = {}
        for j, part in ipairs(parts) do pieces[j] = src[p .. part .. "." .. kind] end
        out["joint_blocks." .. i .. "." .. original .. "." .. kind] = cat(pieces, 0)
      end
    end
  end
end
return out
