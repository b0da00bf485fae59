// BERT encoders, with the pooling of sentence-transformers for sentence embeddings. Parameter
// names are Hugging Face's BertModel names.
#include <ATen/ops/arange.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>

#include "model/registry.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {
namespace {

class Bert final : public Model {
 public:
  Bert(const std::string& name, const Hyperparams& h, c10::ScalarType dtype)
      : Model(name, dtype, "bert.", {"embeddings.position_ids"}),
        hidden_(h.integer("hidden_size")),
        heads_(h.integer("num_attention_heads")),
        vocabulary_(h.integer("vocab_size")),
        positions_(h.integer("max_position_embeddings")),
        types_(h.integer("type_vocab_size", 2)),
        act_(activation(h.string("hidden_act", "gelu"), h.origin())),
        pooling_(h.string("pooling", "mean")),
        normalize_(h.boolean("normalize", false)) {
    h.require(heads_ > 0 && hidden_ % heads_ == 0, "hidden_size (" + std::to_string(hidden_) +
                                                       ") must be a multiple of num_attention_heads (" +
                                                       std::to_string(heads_) + ")");
    if (pooling_ != "mean" && pooling_ != "cls" && pooling_ != "max")
      fail(h.origin(), "pooling " + quote(pooling_) + " is not supported (mean, cls, max)");
    if (h.string("position_embedding_type", "absolute") != "absolute")
      fail(h.origin(), "only absolute position embeddings are supported");
    const int64_t intermediate = h.integer("intermediate_size");
    const double eps = h.number("layer_norm_eps", 1e-12);
    words_ = &embedding("embeddings.word_embeddings", vocabulary_, hidden_);
    positions_layer_ = &embedding("embeddings.position_embeddings", positions_, hidden_);
    types_layer_ = &embedding("embeddings.token_type_embeddings", types_, hidden_);
    embed_norm_ = &layer_norm("embeddings.LayerNorm", hidden_, eps);
    for (int64_t i = 0, n = h.integer("num_hidden_layers"); i < n; ++i) {
      const std::string p = "encoder.layer." + std::to_string(i) + ".";
      blocks_.push_back(Block{
          &linear(p + "attention.self.query", hidden_, hidden_, true),
          &linear(p + "attention.self.key", hidden_, hidden_, true),
          &linear(p + "attention.self.value", hidden_, hidden_, true),
          &linear(p + "attention.output.dense", hidden_, hidden_, true),
          &layer_norm(p + "attention.output.LayerNorm", hidden_, eps),
          &linear(p + "intermediate.dense", hidden_, intermediate, true),
          &linear(p + "output.dense", intermediate, hidden_, true),
          &layer_norm(p + "output.LayerNorm", hidden_, eps),
      });
    }
    if (h.boolean("add_pooling_layer", true)) pooler_ = &linear("pooler.dense", hidden_, hidden_, true);
  }

  storage::NamedTensors forward(const storage::NamedTensors& tensors) override {
    const Inputs inputs(tensors, device());
    const at::Tensor ids = inputs.token_ids("input_ids", vocabulary_);
    const int64_t batch = ids.size(0), length = ids.size(1);
    check_sequence_length(ids, positions_, "max_position_embeddings", "the size of its position embeddings");
    const at::Tensor types = inputs.optional_ids("token_type_ids", ids, types_).value_or(at::zeros_like(ids));
    const at::Tensor positions = at::arange(length, ids.options()).expand({batch, length});
    const at::Tensor keep = inputs.attention_mask(ids);
    const at::Tensor mask = padding_mask(keep, dtype());
    const int64_t head_dim = hidden_ / heads_;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));

    at::Tensor h = (*embed_norm_)((*words_)(ids) + (*types_layer_)(types) + (*positions_layer_)(positions));
    for (auto& b : blocks_) {
      const auto heads = [&](Layer& projection) {
        return projection(h).view({batch, length, heads_, head_dim}).transpose(1, 2);
      };
      const at::Tensor a = attention(heads(*b.query), heads(*b.key), heads(*b.value), mask, scale)
                               .transpose(1, 2)
                               .reshape({batch, length, hidden_});
      const at::Tensor attended = (*b.attention_norm)((*b.attention_out)(a) + h);
      h = (*b.output_norm)((*b.output)(act_((*b.intermediate)(attended))) + attended);
    }

    storage::NamedTensors outputs = {{"last_hidden_state", h}};
    if (pooler_) outputs.emplace_back("pooler_output", at::tanh((*pooler_)(h.select(1, 0))));
    outputs.emplace_back("sentence_embedding", pool(h, keep));
    return outputs;
  }

 private:
  // sentence-transformers' Pooling (and Normalize, when the model has it).
  at::Tensor pool(const at::Tensor& h, const at::Tensor& keep) const {
    const at::Tensor weights = keep.unsqueeze(-1).to(h.scalar_type());
    at::Tensor pooled;
    if (pooling_ == "cls")
      pooled = h.select(1, 0);
    else if (pooling_ == "max")
      pooled = h.masked_fill(weights == 0, -1e9).amax(1);
    else
      pooled = (h * weights).sum(1) / at::clamp_min(weights.sum(1), 1e-9);
    if (normalize_) pooled = pooled / at::clamp_min(pooled.norm(2, {1}, true), 1e-12);
    return pooled;
  }

  struct Block {
    Layer *query, *key, *value, *attention_out, *attention_norm, *intermediate, *output, *output_norm;
  };
  int64_t hidden_, heads_, vocabulary_, positions_, types_;
  Activation act_;
  std::string pooling_;
  bool normalize_;
  Layer *words_, *positions_layer_, *types_layer_, *embed_norm_, *pooler_ = nullptr;
  std::vector<Block> blocks_;
};

}  // namespace

std::unique_ptr<Model> build_bert(const std::string& name, const Hyperparams& h, c10::ScalarType dtype) {
  return std::make_unique<Bert>(name, h, dtype);
}

}  // namespace vramd::model
