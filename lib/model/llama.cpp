// Decoder-only transformers of the LLaMA family: RMSNorm, rotary position embeddings, SwiGLU
// MLP, grouped-query attention; Mistral (sliding window) and Qwen2 (bias on q, k, v) too.
// Parameter names are Hugging Face's LlamaForCausalLM names.
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/where.h>

#include <cmath>
#include <numbers>

#include "model/registry.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {
namespace {

// Rotary frequencies, float32, as Hugging Face computes them for each rope type.
struct Rope {
  at::Tensor inv_freq;
  double attention_scaling = 1.0;
};

Rope make_rope(const Hyperparams& h, int64_t head_dim) {
  // transformers 5 keeps theta and scaling in "rope_parameters"; older configs in "rope_theta"
  // and "rope_scaling".
  const Hyperparams params = h.has("rope_parameters") ? h.object("rope_parameters") : h.object("rope_scaling");
  const double theta = params.number("rope_theta", h.number("rope_theta", 10000.0));
  const std::string type = params.string("rope_type", params.string("type", "default"));
  if (h.number("partial_rotary_factor", 1.0) != 1.0)
    fail(h.origin(), "partial_rotary_factor other than 1 is not supported");

  const at::Tensor exponents = at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / head_dim;
  at::Tensor inv_freq = 1.0 / at::pow(theta, exponents);
  if (type == "default") return {inv_freq};
  if (type == "linear") return {inv_freq / params.number("factor")};
  if (type == "llama3") {
    const double factor = params.number("factor");
    const double low = params.number("low_freq_factor"), high = params.number("high_freq_factor");
    const double context = params.number("original_max_position_embeddings");
    const double low_wavelen = context / low, high_wavelen = context / high;
    const at::Tensor wavelen = 2 * std::numbers::pi / inv_freq;
    const at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / factor, inv_freq);
    const at::Tensor smooth = (context / wavelen - low) / (high - low);
    const at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    const at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
    return {at::where(medium, smoothed, scaled)};
  }
  fail(h.origin(), "rope type " + quote(type) + " is not supported (default, linear, llama3)");
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

class Llama final : public Model {
 public:
  Llama(const std::string& name, const Hyperparams& h, c10::ScalarType dtype)
      : Model(name, dtype, "model.", {".rotary_emb.inv_freq"}),
        hidden_(h.integer("hidden_size")),
        heads_(h.integer("num_attention_heads")),
        kv_heads_(h.integer("num_key_value_heads", heads_)),
        head_dim_(h.integer("head_dim", heads_ > 0 ? hidden_ / heads_ : 0)),
        vocabulary_(h.integer("vocab_size")),
        positions_(h.integer("max_position_embeddings", default_positions(name))),
        act_(activation(h.string("hidden_act", "silu"), h.origin())) {
    h.require(heads_ > 0 && kv_heads_ > 0 && heads_ % kv_heads_ == 0,
              "num_attention_heads (" + std::to_string(heads_) + ") must be a positive multiple of num_key_value_heads (" +
                  std::to_string(kv_heads_) + ")");
    h.require(head_dim_ % 2 == 0, "head_dim must be even for rotary embeddings");
    if (name == "mistral") window_ = h.integer("sliding_window", 0);
    if (name == "qwen2" && h.boolean("use_sliding_window", false))
      fail(h.origin(), "Qwen2's use_sliding_window is not supported");
    rope_ = make_rope(h, head_dim_);

    const bool qkv_bias = name == "qwen2" || h.boolean("attention_bias", false);
    const bool out_bias = name != "qwen2" && h.boolean("attention_bias", false);
    const bool mlp_bias = h.boolean("mlp_bias", false);
    const int64_t intermediate = h.integer("intermediate_size");
    const double eps = h.number("rms_norm_eps", 1e-6);

    embed_ = &embedding("model.embed_tokens", vocabulary_, hidden_);
    for (int64_t i = 0, n = h.integer("num_hidden_layers"); i < n; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      blocks_.push_back(Block{
          &rms_norm(p + "input_layernorm", hidden_, eps),
          &linear(p + "self_attn.q_proj", hidden_, heads_ * head_dim_, qkv_bias),
          &linear(p + "self_attn.k_proj", hidden_, kv_heads_ * head_dim_, qkv_bias),
          &linear(p + "self_attn.v_proj", hidden_, kv_heads_ * head_dim_, qkv_bias),
          &linear(p + "self_attn.o_proj", heads_ * head_dim_, hidden_, out_bias),
          &rms_norm(p + "post_attention_layernorm", hidden_, eps),
          &linear(p + "mlp.gate_proj", hidden_, intermediate, mlp_bias),
          &linear(p + "mlp.up_proj", hidden_, intermediate, mlp_bias),
          &linear(p + "mlp.down_proj", intermediate, hidden_, mlp_bias),
      });
    }
    norm_ = &rms_norm("model.norm", hidden_, eps);
    head_ = &linear("lm_head", hidden_, vocabulary_, false);
    if (h.boolean("tie_word_embeddings", false)) tie(*head_, *embed_);
  }

  storage::NamedTensors forward(const storage::NamedTensors& tensors) override {
    const Inputs inputs(tensors, device());
    const at::Tensor ids = inputs.token_ids("input_ids", vocabulary_);
    check_sequence_length(ids, positions_, "max_position_embeddings",
                          "rotary positions go further: set it higher in the model config's [arch] table");
    const int64_t batch = ids.size(0), length = ids.size(1);
    const at::Tensor positions =
        inputs.optional_ids("position_ids", ids, std::numeric_limits<int64_t>::max())
            .value_or(at::arange(length, ids.options()).expand({batch, length}));

    const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * rope_.inv_freq.to(device()).view({1, 1, -1});
    const at::Tensor angles = at::cat({freqs, freqs}, -1);
    const at::Tensor cos = (angles.cos() * rope_.attention_scaling).to(dtype()).unsqueeze(1);
    const at::Tensor sin = (angles.sin() * rope_.attention_scaling).to(dtype()).unsqueeze(1);
    const at::Tensor mask = causal_mask(inputs.attention_mask(ids), dtype(), window_);
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));

    at::Tensor h = (*embed_)(ids);
    for (auto& b : blocks_) {
      const at::Tensor x = (*b.input_norm)(h);
      const auto heads = [&](Layer& projection, int64_t count) {
        return projection(x).view({batch, length, count, head_dim_}).transpose(1, 2);
      };
      at::Tensor q = heads(*b.q, heads_), k = heads(*b.k, kv_heads_), v = heads(*b.v, kv_heads_);
      q = q * cos + rotate_half(q) * sin;
      k = k * cos + rotate_half(k) * sin;
      const at::Tensor a = attention(q, k, v, mask, scale).transpose(1, 2).reshape({batch, length, heads_ * head_dim_});
      h = h + (*b.o)(a);
      const at::Tensor y = (*b.post_norm)(h);
      h = h + (*b.down)(act_((*b.gate)(y)) * (*b.up)(y));
    }
    h = (*norm_)(h);
    return {{"logits", (*head_)(h)}, {"last_hidden_state", h}};
  }

 private:
  struct Block {
    Layer *input_norm, *q, *k, *v, *o, *post_norm, *gate, *up, *down;
  };
  // transformers' defaults when a config.json leaves max_position_embeddings out.
  static int64_t default_positions(const std::string& family) {
    if (family == "mistral") return 4096 * 32;
    if (family == "qwen2") return 32768;
    return 2048;
  }
  int64_t hidden_, heads_, kv_heads_, head_dim_, vocabulary_, positions_, window_ = 0;
  Activation act_;
  Rope rope_;
  Layer *embed_, *norm_, *head_;
  std::vector<Block> blocks_;
};

}  // namespace

std::unique_ptr<Model> build_llama(const std::string& name, const Hyperparams& h, c10::ScalarType dtype) {
  return std::make_unique<Llama>(name, h, dtype);
}

}  // namespace vramd::model
