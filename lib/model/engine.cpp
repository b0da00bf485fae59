// The one block engine every family runs on (family/blueprint.hpp says which switches a
// checkpoint sets): token, type and position embeddings; blocks of attention and MLP, each
// with its norms before the sublayer, after it, or after the residual; then the heads. Each op
// follows transformers' order and casts, so that outputs match it bit for bit where the same
// kernels run.
#include <ATen/ops/arange.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/log.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>
#include <optional>

#include "model/engine.hpp"
#include "model/rope.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {
namespace {

using family::Blueprint;
using family::Positions;

// T5's bucket of each relative position (key - query) [query, key].
at::Tensor relative_buckets(int64_t length, bool bidirectional, int64_t buckets, int64_t max_distance,
                            const at::TensorOptions& options) {
  const at::Tensor position = at::arange(length, options.dtype(at::kLong));
  at::Tensor relative = position.view({1, length}) - position.view({length, 1});
  at::Tensor bucket = at::zeros_like(relative);
  if (bidirectional) {
    buckets /= 2;
    bucket = bucket + (relative > 0).to(at::kLong) * buckets;
    relative = relative.abs();
  } else {
    relative = -at::minimum(relative, at::zeros_like(relative));
  }
  const int64_t exact = buckets / 2;
  const at::Tensor small = relative < exact;
  at::Tensor large = exact + (at::log(relative.to(at::kFloat) / exact) / std::log(static_cast<double>(max_distance) / exact) *
                              (buckets - exact)).to(at::kLong);
  large = at::minimum(large, at::full_like(large, buckets - 1));
  return bucket + at::where(small, relative, large);
}

// Attention as transformers' eager path computes it, for soft-capped scores, which
// scaled_dot_product_attention does not take. `mask` is additive, [batch, 1, query, key].
at::Tensor eager_attention(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& mask, double scale, double softcap) {
  const int64_t groups = q.size(1) / k.size(1);
  if (groups > 1) {
    k = k.repeat_interleave(groups, 1);
    v = v.repeat_interleave(groups, 1);
  }
  at::Tensor scores = at::matmul(q, k.transpose(2, 3));
  if (scale != 1.0) scores = scores * scale;
  if (softcap > 0) scores = at::tanh(scores / softcap) * softcap;
  scores = scores + mask;
  return at::matmul(at::softmax(scores, -1, at::kFloat).to(q.scalar_type()), v);
}

class Transformer final : public Model {
 public:
  Transformer(Blueprint b, c10::ScalarType dtype)
      : Model(b.family, dtype, b.base_prefix, b.ignored), b_(std::move(b)), act_(activation(b_.activation, b_.origin)) {
    const int64_t hidden = b_.hidden, head_dim = b_.head_dim;
    const int64_t q_width = b_.heads * head_dim, kv_width = b_.kv_heads * head_dim;
    // Registered in the architecture's module order (the family's embedding_order), which is the
    // order device maps place units in, as accelerate does; the forward uses them in its own.
    for (const auto& slot : b_.embedding_order) {
      if (slot == "embed_tokens") embed_tokens_ = &embedding(b_.embed_tokens, b_.vocabulary, hidden);
      else if (slot == "embed_positions" && !b_.embed_positions.empty())
        embed_positions_ = &embedding(b_.embed_positions, b_.max_positions, hidden);
      else if (slot == "embed_types" && !b_.embed_types.empty())
        embed_types_ = &embedding(b_.embed_types, b_.type_vocabulary, hidden);
      else if (slot == "embed_norm" && !b_.embed_norm.empty()) embed_norm_ = &norm(b_.embed_norm, hidden);
    }
    if (!b_.relative_bias.empty()) relative_bias_ = &embedding(b_.relative_bias, b_.relative_buckets, b_.heads);
    for (int64_t i = 0; i < b_.layers; ++i) {
      const auto& n = b_.blocks[i];
      Block block;
      block.attention_norm = optional_norm(n.attention_norm, hidden);
      if (!n.qkv.empty()) block.qkv = &projection(n.qkv, hidden, q_width + 2 * kv_width, b_.qkv_bias);
      else {
        block.q = &projection(n.q, hidden, q_width, b_.qkv_bias);
        block.k = &projection(n.k, hidden, kv_width, b_.qkv_bias);
        block.v = &projection(n.v, hidden, kv_width, b_.qkv_bias);
      }
      if (!n.q_norm.empty()) {
        block.q_norm = &norm(n.q_norm, b_.full_qk_norm ? q_width : head_dim);
        block.k_norm = &norm(n.k_norm, b_.full_qk_norm ? kv_width : head_dim);
      }
      block.o = &projection(n.o, q_width, hidden, b_.o_bias);
      block.attention_post_norm = optional_norm(n.attention_post_norm, hidden);
      block.attention_residual_norm = optional_norm(n.attention_residual_norm, hidden);
      block.mlp_norm = optional_norm(n.mlp_norm, hidden);
      if (b_.sparse[i]) {  // in transformers' module order: router, experts, shared expert, its gate
        block.router = &linear(n.router, hidden, b_.experts, false);
        for (const auto& names : n.experts) {
          block.experts.push_back(expert(names, b_.expert_intermediate));
          for (Layer* layer : {block.experts.back().gate, block.experts.back().up, block.experts.back().down}) layer->mark_routed();
        }
        if (b_.shared_intermediate > 0) {
          block.shared_expert = expert(n.shared_expert, b_.shared_intermediate);
          if (!n.shared_expert_gate.empty()) block.shared_expert_gate = &linear(n.shared_expert_gate, hidden, 1, false);
        }
      } else if (!n.gate_up.empty()) {
        block.gate_up = &projection(n.gate_up, hidden, 2 * b_.intermediate, b_.mlp_bias);
      } else {
        if (b_.mlp_gated) block.gate = &projection(n.gate, hidden, b_.intermediate, b_.mlp_bias);
        block.up = &projection(n.up, hidden, b_.intermediate, b_.mlp_bias);
      }
      if (!b_.sparse[i]) block.down = &projection(n.down, b_.intermediate, hidden, b_.mlp_bias);
      block.mlp_post_norm = optional_norm(n.mlp_post_norm, hidden);
      block.mlp_residual_norm = optional_norm(n.mlp_residual_norm, hidden);
      block.sliding = b_.sliding[i];
      blocks_.push_back(block);
    }
    if (!b_.final_norm.empty()) final_norm_ = &norm(b_.final_norm, hidden);
    if (!b_.lm_head.empty()) {
      lm_head_ = &linear(b_.lm_head, hidden, b_.vocabulary, false);
      if (b_.tie_word_embeddings) tie(*lm_head_, *embed_tokens_);
    }
    if (!b_.pooler.empty()) pooler_ = &linear(b_.pooler, hidden, hidden, true);
    if (!b_.projection.empty()) projection_ = &linear(b_.projection, hidden, b_.projection_dim, false);
    // What forward() reads: transformers' names of the same inputs.
    input_names_ = {"input_ids", "attention_mask"};
    if (embed_positions_ || b_.positions == Positions::Rope) input_names_.push_back("position_ids");
    if (embed_types_) input_names_.push_back("token_type_ids");
    if (b_.experts > 0) input_names_.push_back("output_router_logits");
    if (b_.positions == Positions::Rope) {
      const auto rotary = static_cast<int64_t>(static_cast<double>(head_dim) * b_.rope.partial);
      rope_.emplace(b_.rope, rotary, b_.max_positions);
      local_rope_.emplace(b_.local_rope, static_cast<int64_t>(static_cast<double>(head_dim) * b_.local_rope.partial),
                          b_.max_positions);
    }
  }

  storage::NamedTensors forward(const storage::NamedTensors& tensors) override {
    const Inputs inputs(tensors, device(), input_names_);
    const at::Tensor ids = inputs.token_ids("input_ids", b_.vocabulary);
    const int64_t batch = ids.size(0), length = ids.size(1);
    // RoBERTa's positions start after pad_token_id.
    const int64_t position_limit = b_.max_positions - (b_.padding_positions ? b_.pad_token + 1 : 0);
    if (b_.max_positions > 0 && b_.positions != Positions::Relative && b_.positions != Positions::None)
      check_sequence_length(ids, position_limit, b_.max_positions_key,
                            b_.positions == Positions::Rope
                                ? "rotary positions go further: set it higher in the model config's [arch] table"
                                : "the size of its position embeddings");
    const at::Tensor keep = inputs.attention_mask(ids);

    at::Tensor h = (*embed_tokens_)(ids);
    if (b_.embed_scale_sqrt_hidden) h = h * at::scalar_tensor(std::sqrt(static_cast<double>(b_.hidden)), h.options());
    if (embed_types_) h = h + (*embed_types_)(inputs.optional_ids("token_type_ids", ids, b_.type_vocabulary).value_or(at::zeros_like(ids)));
    const at::Tensor positions = position_ids(inputs, ids);
    if (embed_positions_) h = h + (*embed_positions_)(positions);
    if (embed_norm_) h = (*embed_norm_)(h);

    // Masks: one for full attention, one for the sliding layers; T5's bias instead.
    at::Tensor full_mask, sliding_mask;
    if (b_.causal) {
      full_mask = causal_mask(keep, dtype());
      if (b_.sliding_window > 0) sliding_mask = causal_mask(keep, dtype(), b_.sliding_window);
    } else {
      full_mask = padding_mask(keep, dtype());
    }
    if (relative_bias_) {
      const at::Tensor buckets = relative_buckets(length, !b_.causal, b_.relative_buckets, b_.relative_max_distance, ids.options());
      full_mask = (*relative_bias_)(buckets).permute({2, 0, 1}).unsqueeze(0) + full_mask;
    }
    std::optional<std::pair<at::Tensor, at::Tensor>> rotation, local_rotation;
    if (rope_) {
      const c10::ScalarType rotary_dtype = b_.rotary_in_float ? at::kFloat : dtype();
      rotation = rope_->tables(positions, rotary_dtype);
      local_rotation = local_rope_->tables(positions, rotary_dtype);
    }

    // Each sparse block's router logits [tokens, experts], when asked for.
    std::vector<at::Tensor> router_logits;
    const bool keep_router_logits = b_.experts > 0 && inputs.flag("output_router_logits");
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Block& block = blocks_[i];
      const at::Tensor& mask = block.sliding ? sliding_mask : full_mask;
      const auto* rotary = block.sliding ? (local_rotation ? &*local_rotation : nullptr) : (rotation ? &*rotation : nullptr);
      double scale = b_.attention_scale;
      if (b_.scale_by_inverse_layer) scale /= static_cast<double>(i + 1);
      const at::Tensor x = block.attention_norm ? (*block.attention_norm)(h) : h;
      at::Tensor out = (*block.o)(attend(block, x, mask, rotary, scale, batch, length));
      if (block.attention_post_norm) out = (*block.attention_post_norm)(out);
      h = h + out;
      if (block.attention_residual_norm) h = (*block.attention_residual_norm)(h);

      const at::Tensor y = block.mlp_norm ? (*block.mlp_norm)(h) : h;
      out = block.router ? mixture(block, y, keep_router_logits ? &router_logits : nullptr) : mlp(block, y);
      if (block.mlp_post_norm) out = (*block.mlp_post_norm)(out);
      h = h + out;
      if (block.mlp_residual_norm) h = (*block.mlp_residual_norm)(h);
    }
    if (final_norm_) h = (*final_norm_)(h);
    storage::NamedTensors outputs = heads(h, ids, keep);
    // [sparse layers, batch * sequence, experts], as transformers' router_logits stacked.
    if (keep_router_logits) outputs.emplace_back("router_logits", at::stack(router_logits));
    return outputs;
  }

 private:
  // A gated MLP of its own weights: one expert of a mixture, or its shared expert.
  struct Expert {
    Layer *gate = nullptr, *up = nullptr, *down = nullptr;
  };

  struct Block {
    Layer *attention_norm = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *qkv = nullptr, *q_norm = nullptr,
          *k_norm = nullptr, *o = nullptr, *attention_post_norm = nullptr, *attention_residual_norm = nullptr;
    Layer *mlp_norm = nullptr, *gate = nullptr, *up = nullptr, *gate_up = nullptr, *down = nullptr,
          *mlp_post_norm = nullptr, *mlp_residual_norm = nullptr;
    Layer *router = nullptr, *shared_expert_gate = nullptr;  // a sparse block's
    std::vector<Expert> experts;
    Expert shared_expert;
    bool sliding = false;
  };

  Expert expert(const family::ExpertNames& names, int64_t intermediate) {
    Expert e;
    e.gate = &linear(names.gate, b_.hidden, intermediate, false);
    e.up = &linear(names.up, b_.hidden, intermediate, false);
    e.down = &linear(names.down, intermediate, b_.hidden, false);
    return e;
  }

  // gate before up, in two statements: the operands of * are evaluated in no fixed order, and
  // the order layers are asked for is the order streamed weights prefetch in.
  at::Tensor gated(const Expert& e, const at::Tensor& x) const {
    const at::Tensor gate = act_((*e.gate)(x));
    return (*e.down)(gate * (*e.up)(x));
  }

  // A dense block's MLP.
  at::Tensor mlp(Block& block, const at::Tensor& y) const {
    if (block.gate) return gated({block.gate, block.up, block.down}, y);
    if (block.gate_up) {
      const auto halves = (*block.gate_up)(y).chunk(2, -1);
      return (*block.down)(halves[1] * act_(halves[0]));
    }
    return (*block.down)(act_((*block.up)(y)));
  }

  // A sparse block's MLP, as transformers' sparse MoE blocks compute it by default (the grouped
  // experts): the router's softmax in float32, the top experts of each token, their weights
  // renormalised (norm_topk_prob) and cast back unless kept in float32; each expert the batch
  // chose runs on its tokens alone, in ascending order; each token's weighted outputs are summed
  // over its top k at once (in float32 for a lower precision), then cast to the dtype. Experts
  // no token chose are never asked for their weights, so a streamed model moves only the routed.
  at::Tensor mixture(Block& block, const at::Tensor& y, std::vector<at::Tensor>* router_logits) const {
    const int64_t k = b_.experts_per_token;
    const at::Tensor x = y.reshape({-1, b_.hidden});
    at::Tensor shared;
    if (block.shared_expert.down) shared = gated(block.shared_expert, x);
    const at::Tensor logits = (*block.router)(x);
    if (router_logits) router_logits->push_back(logits);
    auto [weights, chosen] = at::topk(at::softmax(logits, -1, at::kFloat), k, -1);
    if (b_.norm_topk_prob) weights = weights / weights.sum(-1, true);
    if (!b_.router_weights_in_float) weights = weights.to(logits.scalar_type());
    // One row per (token, place in its top k), grouped by expert.
    const at::Tensor flat = chosen.reshape(-1), flat_weights = weights.reshape(-1);
    const at::Tensor order = std::get<1>(flat.sort(/*stable=*/std::optional<bool>(true), 0));
    const at::Tensor counts = at::bincount(flat, {}, b_.experts).cpu();
    const auto* count = counts.const_data_ptr<int64_t>();
    std::vector<const Layer*> routed;  // the routed experts' layers, in the order they run
    for (int64_t e = 0; e < b_.experts; ++e)
      if (count[e] > 0) routed.insert(routed.end(), {block.experts[e].gate, block.experts[e].up, block.experts[e].down});
    Layer::expect(routed);
    at::Tensor weighted = at::empty({flat.size(0), b_.hidden}, x.options().dtype(at::promote_types(x.scalar_type(), weights.scalar_type())));
    int64_t start = 0;
    for (int64_t e = 0; e < b_.experts; ++e) {
      if (count[e] == 0) continue;
      const at::Tensor rows = order.narrow(0, start, count[e]);
      start += count[e];
      const at::Tensor h = gated(block.experts[static_cast<size_t>(e)], x.index_select(0, rows.div(k, "floor")));
      weighted.index_copy_(0, rows, h * flat_weights.index_select(0, rows).unsqueeze(-1));
    }
    at::Tensor out = weighted.view({x.size(0), k, b_.hidden}).sum(1).to(x.scalar_type());
    if (shared.defined()) {
      if (block.shared_expert_gate) shared = at::sigmoid((*block.shared_expert_gate)(x)) * shared;
      out = out + shared;
    }
    return out.view(y.sizes());
  }

  Layer& norm(const std::string& path, int64_t dim) {
    if (b_.norm == family::NormKind::Layer) return layer_norm(path, dim, b_.norm_eps, b_.norm_bias);
    return rms_norm(path, dim, b_.norm_eps, b_.norm_offset, b_.norm_in_float);
  }
  Layer* optional_norm(const std::string& path, int64_t dim) { return path.empty() ? nullptr : &norm(path, dim); }
  Layer& projection(const std::string& path, int64_t in, int64_t out, bool bias) {
    return b_.conv1d ? conv1d(path, in, out) : linear(path, in, out, bias);
  }

  at::Tensor position_ids(const Inputs& inputs, const at::Tensor& ids) const {
    const int64_t batch = ids.size(0), length = ids.size(1);
    const int64_t limit = b_.positions == Positions::Learned ? b_.max_positions : std::numeric_limits<int64_t>::max();
    if (auto given = inputs.optional_ids("position_ids", ids, limit)) return *given;
    if (b_.padding_positions) {  // RoBERTa: tokens count from pad_token_id + 1, padding stays at it
      const at::Tensor tokens = ids.ne(b_.pad_token).to(at::kInt);
      return (at::cumsum(tokens, 1).to(at::kInt) * tokens).to(at::kLong) + b_.pad_token;
    }
    return at::arange(length, ids.options()).expand({batch, length});
  }

  // Attention of one block, [batch, sequence, heads * head_dim] before the output projection.
  at::Tensor attend(Block& block, const at::Tensor& x, const at::Tensor& mask,
                    const std::pair<at::Tensor, at::Tensor>* rotary, double scale, int64_t batch, int64_t length) {
    const int64_t head_dim = b_.head_dim;
    at::Tensor q, k, v;
    if (block.qkv) {
      const auto parts = (*block.qkv)(x).split_with_sizes({b_.heads * head_dim, b_.kv_heads * head_dim, b_.kv_heads * head_dim}, -1);
      q = parts[0], k = parts[1], v = parts[2];
    } else {
      q = (*block.q)(x), k = (*block.k)(x), v = (*block.v)(x);
    }
    if (block.q_norm && b_.full_qk_norm) {
      q = (*block.q_norm)(q);
      k = (*block.k_norm)(k);
    }
    if (b_.clip_qkv > 0) {
      q = q.clamp(-b_.clip_qkv, b_.clip_qkv);
      k = k.clamp(-b_.clip_qkv, b_.clip_qkv);
      v = v.clamp(-b_.clip_qkv, b_.clip_qkv);
    }
    q = q.view({batch, length, b_.heads, head_dim});
    k = k.view({batch, length, b_.kv_heads, head_dim});
    if (block.q_norm && !b_.full_qk_norm) {
      q = (*block.q_norm)(q);
      k = (*block.k_norm)(k);
    }
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
    v = v.view({batch, length, b_.kv_heads, head_dim}).transpose(1, 2);
    if (rotary) {
      q = RotaryEmbedding::apply(q, rotary->first, rotary->second).to(dtype());
      k = RotaryEmbedding::apply(k, rotary->first, rotary->second).to(dtype());
    }
    // scaled_dot_product_attention, as transformers runs every family but Gemma 2, whose
    // soft-capped scores only its eager path computes.
    const at::Tensor a = b_.eager_attention ? eager_attention(q, k, v, mask, scale, b_.attention_softcap)
                                            : attention(q, k, v, mask, scale);
    return a.transpose(1, 2).reshape({batch, length, b_.heads * head_dim});
  }

  storage::NamedTensors heads(at::Tensor h, const at::Tensor& ids, const at::Tensor& keep) {
    storage::NamedTensors outputs;
    if (lm_head_) {
      at::Tensor logits = (*lm_head_)(h);
      if (b_.final_softcap > 0) logits = at::tanh(logits / b_.final_softcap) * b_.final_softcap;
      outputs.emplace_back("logits", logits);
    }
    outputs.emplace_back("last_hidden_state", h);
    if (b_.pool_eos) {  // CLIP: the hidden state at each row's end-of-text token
      const at::Tensor at_eos = b_.eos_token == 2 ? ids.argmax(-1) : (ids == b_.eos_token).to(at::kInt).argmax(-1);
      const at::Tensor pooled = h.index({at::arange(h.size(0), ids.options()), at_eos});
      outputs.emplace_back("pooler_output", pooled);
      if (projection_) outputs.emplace_back("text_embeds", (*projection_)(pooled));
    } else if (pooler_) {
      outputs.emplace_back("pooler_output", at::tanh((*pooler_)(h.select(1, 0))));
    }
    if (b_.sentence_embedding) outputs.emplace_back("sentence_embedding", sentence_embedding(h, keep));
    return outputs;
  }

  // sentence-transformers' Pooling (and Normalize, when the model has it).
  at::Tensor sentence_embedding(const at::Tensor& h, const at::Tensor& keep) const {
    const at::Tensor weights = keep.unsqueeze(-1).to(h.scalar_type());
    at::Tensor pooled;
    if (b_.pooling == "cls")
      pooled = h.select(1, 0);
    else if (b_.pooling == "max")
      pooled = h.masked_fill(weights == 0, -1e9).amax(1);
    else
      pooled = (h * weights).sum(1) / at::clamp_min(weights.sum(1), 1e-9);
    if (b_.normalize) pooled = pooled / at::clamp_min(pooled.norm(2, {1}, true), 1e-12);
    return pooled;
  }

  Blueprint b_;
  Activation act_;
  Layer *embed_tokens_ = nullptr, *embed_types_ = nullptr, *embed_positions_ = nullptr, *embed_norm_ = nullptr,
        *relative_bias_ = nullptr, *final_norm_ = nullptr, *lm_head_ = nullptr, *pooler_ = nullptr, *projection_ = nullptr;
  std::vector<Block> blocks_;
  std::vector<std::string> input_names_;  // what forward() reads
  std::optional<RotaryEmbedding> rope_, local_rope_;
};

}  // namespace

std::unique_ptr<Model> build_transformer(family::Blueprint blueprint, c10::ScalarType dtype) {
  return std::make_unique<Transformer>(std::move(blueprint), dtype);
}

}  // namespace vramd::model
