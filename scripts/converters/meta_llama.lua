-- Meta's original LLaMA layout (consolidated.*.pth) -> Hugging Face LLaMA names and layout.
--
-- Besides the renames, q and k are permuted: Meta's rotary embedding rotates interleaved pairs
-- of each head's dimensions (0 with 1, 2 with 3, ...), Hugging Face's rotates halves (0 with
-- d/2, ...), so each head's rows are reordered from interleaved to halves. The number of heads
-- comes from the model config's [arch] table (n_heads, or num_attention_heads); the number of
-- key/value heads follows from wk's shape.

local heads = arch.n_heads or arch.num_attention_heads
assert(heads, "set n_heads (or num_attention_heads) in the model config's [arch] table")

local names = {
  ["attention.wo.weight"] = "self_attn.o_proj.weight",
  ["attention.wv.weight"] = "self_attn.v_proj.weight",
  ["feed_forward.w1.weight"] = "mlp.gate_proj.weight",
  ["feed_forward.w2.weight"] = "mlp.down_proj.weight",
  ["feed_forward.w3.weight"] = "mlp.up_proj.weight",
  ["attention_norm.weight"] = "input_layernorm.weight",
  ["ffn_norm.weight"] = "post_attention_layernorm.weight",
}
local exact = {
  ["tok_embeddings.weight"] = "model.embed_tokens.weight",
  ["norm.weight"] = "model.norm.weight",
  ["output.weight"] = "lm_head.weight",
}

-- Rows of each head from interleaved pairs to two halves.
local function halves(t, head_dim)
  local rows, columns = t.shape[1], t.shape[2]
  return t:reshape({ rows / head_dim, head_dim / 2, 2, columns }):transpose(1, 2):reshape({ rows, columns })
end

local out = {}
local head_dim = src["tok_embeddings.weight"].shape[2] / heads
for name, t in src:items() do
  local layer, rest = name:match("^layers%.(%d+)%.(.+)$")
  local p = layer and ("model.layers." .. layer .. ".") or nil
  if rest == "attention.wq.weight" then
    out[p .. "self_attn.q_proj.weight"] = halves(t, head_dim)
  elseif rest == "attention.wk.weight" then
    out[p .. "self_attn.k_proj.weight"] = halves(t, head_dim)
  elseif layer and names[rest] then
    out[p .. names[rest]] = t
  elseif exact[name] then
    out[exact[name]] = t
  elseif name ~= "rope.freqs" then
    error("unexpected key '" .. name .. "' in a Meta LLaMA checkpoint")
  end
end
return out
