-- Meta's original LLaMA layout (consolidated.NN.pth) -> Hugging Face LLaMA names and layout.
--
-- One file or several: LLaMA-2-13B and larger come as consolidated.00.pth, consolidated.01.pth,
-- ..., each holding a slice of every tensor, as Meta's tensor-parallel layers split them. Load
-- them together (checkpoint = "/models/llama-2-13b/consolidated.*.pth"); each weight is joined
-- from its slices, in file order, along the dimension its layer splits:
--   wq, wk, wv, w1, w3, output   (ColumnParallelLinear)  by rows
--   wo, w2                       (RowParallelLinear)     by columns
--   tok_embeddings               by columns in LLaMA 1 and 2 (ParallelEmbedding), by rows in
--                                LLaMA 3 (VocabParallelEmbedding): told apart by the slices' shape
--   the norms                    whole in every file
--
-- Besides the renames, q and k are permuted: Meta's rotary embedding rotates interleaved pairs
-- of each head's dimensions (0 with 1, 2 with 3, ...), Hugging Face's rotates halves (0 with
-- d/2, ...), so each head's rows are reordered from interleaved to halves. The number of heads
-- comes from the folder's params.json (n_heads, read as num_attention_heads) or the model
-- config's [arch] table; the number of key/value heads follows from wk's shape.

local heads = arch.n_heads or arch.num_attention_heads
assert(heads, "no n_heads in params.json: set n_heads (or num_attention_heads) in the model config's [arch] table")

local rows, columns, whole = 0, 1, "whole"
-- Meta's name within a layer -> Hugging Face's, and the dimension its slices join along.
local layer_names = {
  ["attention.wq.weight"] = { "self_attn.q_proj.weight", rows },
  ["attention.wk.weight"] = { "self_attn.k_proj.weight", rows },
  ["attention.wv.weight"] = { "self_attn.v_proj.weight", rows },
  ["attention.wo.weight"] = { "self_attn.o_proj.weight", columns },
  ["feed_forward.w1.weight"] = { "mlp.gate_proj.weight", rows },
  ["feed_forward.w2.weight"] = { "mlp.down_proj.weight", columns },
  ["feed_forward.w3.weight"] = { "mlp.up_proj.weight", rows },
  ["attention_norm.weight"] = { "input_layernorm.weight", whole },
  ["ffn_norm.weight"] = { "post_attention_layernorm.weight", whole },
}
local dim = src:shards("norm.weight")[1].shape[1]
local head_dim = dim / heads

-- The whole tensor from its slices.
local function joined(name, along)
  local slices = src:shards(name)
  if #slices == 1 or along == whole then return slices[1] end
  return cat(slices, along)
end

-- The embedding's slices are [vocab, dim / n] in LLaMA 1 and 2, [vocab / n, dim] in LLaMA 3.
local function embedding(name)
  local first = src:shards(name)[1]
  return joined(name, first.shape[2] == dim and rows or columns)
end

-- Rows of each head from interleaved pairs to two halves.
local function halves(t)
  local n, width = t.shape[1], t.shape[2]
  return t:reshape({ n / head_dim, head_dim / 2, 2, width }):transpose(1, 2):reshape({ n, width })
end

local exact = {
  ["tok_embeddings.weight"] = { "model.embed_tokens.weight", embedding },
  ["norm.weight"] = { "model.norm.weight", function(name) return joined(name, whole) end },
  ["output.weight"] = { "lm_head.weight", function(name) return joined(name, rows) end },
}

local out = {}
for _, name in ipairs(src:keys()) do
  local layer, rest = name:match("^layers%.(%d+)%.(.+)$")
  local rule = layer and layer_names[rest]
  if rule then
    local t = joined(name, rule[2])
    if rest == "attention.wq.weight" or rest == "attention.wk.weight" then t = halves(t) end
    out["model.layers." .. layer .. "." .. rule[1]] = t
  elseif exact[name] then
    out[exact[name][1]] = exact[name][2](name)
  elseif name ~= "rope.freqs" then
    error("unexpected key '" .. name .. "' in a Meta LLaMA checkpoint")
  end
end
return out
