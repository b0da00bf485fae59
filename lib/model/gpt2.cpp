// GPT-2: learned positions, pre-LayerNorm blocks, fused q/k/v in a Conv1D, tied LM head.
// Parameter names are Hugging Face's GPT2LMHeadModel names.
#include <ATen/ops/arange.h>

#include <cmath>

#include "model/registry.hpp"
#include "util/error.hpp"

namespace vramd::model {
namespace {

class Gpt2 final : public Model {
 public:
  Gpt2(const std::string& name, const Hyperparams& h, c10::ScalarType dtype)
      : Model(name, dtype, "transformer.", {".attn.bias", ".attn.masked_bias"}),
        hidden_(h.integer("n_embd")),
        heads_(h.integer("n_head")),
        vocabulary_(h.integer("vocab_size")),
        positions_(h.integer("n_positions")),
        act_(activation(h.string("activation_function", "gelu_new"), h.origin())),
        scale_weights_(h.boolean("scale_attn_weights", true)),
        scale_by_layer_(h.boolean("scale_attn_by_inverse_layer_idx", false)) {
    h.require(heads_ > 0 && hidden_ % heads_ == 0,
              "n_embd (" + std::to_string(hidden_) + ") must be a multiple of n_head (" + std::to_string(heads_) + ")");
    const int64_t inner = h.integer("n_inner", 4 * hidden_);
    const double eps = h.number("layer_norm_epsilon", 1e-5);
    wte_ = &embedding("transformer.wte", vocabulary_, hidden_);
    wpe_ = &embedding("transformer.wpe", positions_, hidden_);
    for (int64_t i = 0, n = h.integer("n_layer"); i < n; ++i) {
      const std::string p = "transformer.h." + std::to_string(i) + ".";
      blocks_.push_back(Block{
          &layer_norm(p + "ln_1", hidden_, eps),
          &conv1d(p + "attn.c_attn", hidden_, 3 * hidden_),
          &conv1d(p + "attn.c_proj", hidden_, hidden_),
          &layer_norm(p + "ln_2", hidden_, eps),
          &conv1d(p + "mlp.c_fc", hidden_, inner),
          &conv1d(p + "mlp.c_proj", inner, hidden_),
      });
    }
    ln_f_ = &layer_norm("transformer.ln_f", hidden_, eps);
    head_ = &linear("lm_head", hidden_, vocabulary_, false);
    if (h.boolean("tie_word_embeddings", true)) tie(*head_, *wte_);
  }

  storage::NamedTensors forward(const storage::NamedTensors& tensors) override {
    const Inputs inputs(tensors, device());
    const at::Tensor ids = inputs.token_ids("input_ids", vocabulary_);
    const int64_t batch = ids.size(0), length = ids.size(1);
    const at::Tensor positions = inputs.optional_ids("position_ids", ids, positions_)
                                     .value_or(at::arange(length, ids.options()).expand({batch, length}));
    check_sequence_length(ids, positions_, "n_positions", "the size of its position embeddings");
    const at::Tensor mask = causal_mask(inputs.attention_mask(ids), dtype());
    const int64_t head_dim = hidden_ / heads_;

    at::Tensor h = (*wte_)(ids) + (*wpe_)(positions);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Block& b = blocks_[i];
      const auto parts = (*b.c_attn)((*b.ln_1)(h)).split(hidden_, 2);
      const auto heads = [&](const at::Tensor& x) { return x.view({batch, length, heads_, head_dim}).transpose(1, 2); };
      double scale = scale_weights_ ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
      if (scale_by_layer_) scale /= static_cast<double>(i + 1);
      const at::Tensor a = attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), mask, scale);
      h = h + (*b.c_proj)(a.transpose(1, 2).reshape({batch, length, hidden_}));
      h = h + (*b.fc_out)(act_((*b.fc_in)((*b.ln_2)(h))));
    }
    h = (*ln_f_)(h);
    return {{"logits", (*head_)(h)}, {"last_hidden_state", h}};
  }

 private:
  struct Block {
    Layer *ln_1, *c_attn, *c_proj, *ln_2, *fc_in, *fc_out;
  };
  int64_t hidden_, heads_, vocabulary_, positions_;
  Activation act_;
  bool scale_weights_, scale_by_layer_;
  Layer *wte_, *wpe_, *ln_f_, *head_;
  std::vector<Block> blocks_;
};

}  // namespace

std::unique_ptr<Model> build_gpt2(const std::string& name, const Hyperparams& h, c10::ScalarType dtype) {
  return std::make_unique<Gpt2>(name, h, dtype);
}

}  // namespace vramd::model
