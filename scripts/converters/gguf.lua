-- llama.cpp's GGUF tensor names -> Hugging Face's, for the families vramd runs from GGUF
-- (llama, qwen2, qwen3, phi3, gemma2, gemma3, and the mixtures of experts mixtral, qwen2_moe,
-- qwen3_moe, olmoe). The hyperparameters come from the file's metadata
-- (model/gguf_config.cpp).
--
-- llama.cpp's converter reorders the rows of each head of LLaMA's q and k from Hugging Face's
-- rotary layout (dimension i rotates with i + d/2) to Meta's (pairs 2i, 2i+1 rotate together);
-- this undoes it, as transformers does when it reads GGUF. The others' are stored as they are
-- (llama.cpp computes them with the rotary layout Hugging Face's has: NEOX).
-- Phi-3 keeps its fused projections fused: attn_qkv, and ffn_up holding gate then up. Gemma's
-- norms scale by 1 + w, and llama.cpp stores 1 + w: one is taken off again, as transformers does.

local heads = arch.num_attention_heads
local head_dim = arch.head_dim or arch.hidden_size / heads
local mixtral = arch.model_type == "mixtral"
local reorder = arch.model_type == "llama" or mixtral

local layer_names = {
  ["attn_norm.weight"] = "input_layernorm.weight",
  ["ffn_norm.weight"] = "post_attention_layernorm.weight",
  ["attn_q.weight"] = "self_attn.q_proj.weight",
  ["attn_k.weight"] = "self_attn.k_proj.weight",
  ["attn_v.weight"] = "self_attn.v_proj.weight",
  ["attn_output.weight"] = "self_attn.o_proj.weight",
  ["attn_q.bias"] = "self_attn.q_proj.bias",
  ["attn_k.bias"] = "self_attn.k_proj.bias",
  ["attn_v.bias"] = "self_attn.v_proj.bias",
  ["ffn_gate.weight"] = "mlp.gate_proj.weight",
  ["ffn_up.weight"] = "mlp.up_proj.weight",
  ["ffn_down.weight"] = "mlp.down_proj.weight",
  ["attn_q_norm.weight"] = "self_attn.q_norm.weight",
  ["attn_k_norm.weight"] = "self_attn.k_norm.weight",
  ["attn_qkv.weight"] = "self_attn.qkv_proj.weight",
}
if arch.model_type == "phi3" then
  layer_names["ffn_up.weight"] = "mlp.gate_up_proj.weight"
end
local gemma = arch.model_type == "gemma2" or arch.model_type == "gemma3_text"
if gemma then  -- a norm before and after each sublayer
  layer_names["post_attention_norm.weight"] = "post_attention_layernorm.weight"
  layer_names["ffn_norm.weight"] = "pre_feedforward_layernorm.weight"
  layer_names["post_ffw_norm.weight"] = "post_feedforward_layernorm.weight"
end
-- Mixtures of experts: each layer's experts stacked into one 3-D tensor per projection
-- ([experts, rows, columns]), each taken back out as its expert's own weight (rows of blocks,
-- so packed blocks stay packed); the router, and Qwen2-MoE's shared expert and its gate (a
-- vector in the file, a one-row weight in transformers).
local moe = mixtral and "block_sparse_moe." or "mlp."
local experts = {
  ["ffn_gate_exps.weight"] = mixtral and "w1" or "gate_proj",
  ["ffn_up_exps.weight"] = mixtral and "w3" or "up_proj",
  ["ffn_down_exps.weight"] = mixtral and "w2" or "down_proj",
}
layer_names["ffn_gate_inp.weight"] = moe .. "gate.weight"
layer_names["ffn_gate_shexp.weight"] = "mlp.shared_expert.gate_proj.weight"
layer_names["ffn_up_shexp.weight"] = "mlp.shared_expert.up_proj.weight"
layer_names["ffn_down_shexp.weight"] = "mlp.shared_expert.down_proj.weight"
layer_names["ffn_gate_inp_shexp.weight"] = "mlp.shared_expert_gate.weight"

local names = {
  ["token_embd.weight"] = "model.embed_tokens.weight",
  ["output_norm.weight"] = "model.norm.weight",
  ["output.weight"] = "lm_head.weight",
}

-- Each head's rows from interleaved pairs back to two halves.
local function halves(t)
  local rows = t.shape[1]
  if #t.shape == 1 then
    return t:reshape({ rows / head_dim, head_dim / 2, 2 }):transpose(1, 2):reshape({ rows })
  end
  local columns = t.shape[2]
  return t:reshape({ rows / head_dim, head_dim / 2, 2, columns }):transpose(1, 2):reshape({ rows, columns })
end

local out = {}
for name, t in src:items() do
  if gemma and name:match("norm%.weight$") then t = t:shift(-1) end
  local layer, rest = name:match("^blk%.(%d+)%.(.+)$")
  if layer and experts[rest] then
    local prefix = "model.layers." .. layer .. "." .. moe .. "experts."
    for e = 0, t.shape[1] - 1 do
      out[prefix .. e .. "." .. experts[rest] .. ".weight"] = t:narrow(0, e, 1):reshape({ t.shape[2], t.shape[3] })
    end
  elseif layer and layer_names[rest] then
    local target = "model.layers." .. layer .. "." .. layer_names[rest]
    local rotary = rest:match("^attn_[qk]%.")
    if rest == "ffn_gate_inp_shexp.weight" and #t.shape == 1 then t = t:reshape({ 1, t.shape[1] }) end
    out[target] = (reorder and rotary) and halves(t) or t
  elseif names[name] then
    out[names[name]] = t
  else
    error("GGUF tensor '" .. name .. "' is not read for " .. arch.model_type ..
          " (rope_freqs, rope_factors_long/short: LLaMA 3.1's and LongRoPE's rope scaling are not read yet)")
  end
end
return out
