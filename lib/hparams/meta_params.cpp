#include "hparams/meta_params.hpp"

#include <algorithm>
#include <iterator>
#include <nlohmann/json.hpp>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::hparams {
namespace {

using Json = nlohmann::json;

// params.json's keys to Hugging Face's, where the value carries over as it is.
constexpr std::pair<const char*, const char*> kKeys[] = {
    {"dim", "hidden_size"},
    {"n_layers", "num_hidden_layers"},
    {"n_heads", "num_attention_heads"},
    {"n_kv_heads", "num_key_value_heads"},
    {"norm_eps", "rms_norm_eps"},
    {"rope_theta", "rope_theta"},
    {"head_dim", "head_dim"},
    {"hidden_dim", "intermediate_size"},  // Mistral's params.json gives it outright
};
// Read into other keys below, or settings of Meta's own code that are not the model's.
constexpr const char* kOtherKeys[] = {"vocab_size", "multiple_of", "ffn_dim_multiplier", "use_scaled_rope",
                                      "max_seq_len", "max_batch_size"};

int64_t integer(const Json& params, const std::string& path, const char* key) {
  const auto it = params.find(key);
  if (it == params.end() || !it->is_number_integer())
    fail(path, "needs " + quote(key) + " as an integer" + (it == params.end() ? "" : ", found " + it->dump()));
  return it->get<int64_t>();
}

// The MLP's width as Meta's FeedForward computes it (and transformers' compute_intermediate_size):
// two thirds of 4 * dim, times ffn_dim_multiplier, rounded up to a multiple of multiple_of.
int64_t intermediate_size(const Json& params, const std::string& path) {
  const int64_t dim = integer(params, path, "dim");
  const int64_t multiple_of = params.contains("multiple_of") ? integer(params, path, "multiple_of") : 256;
  if (multiple_of <= 0) fail(path, "multiple_of must be positive, found " + std::to_string(multiple_of));
  double multiplier = 1.0;
  if (const auto it = params.find("ffn_dim_multiplier"); it != params.end() && !it->is_null()) {
    if (!it->is_number()) fail(path, "ffn_dim_multiplier must be a number, found " + it->dump());
    multiplier = it->get<double>();
  }
  const auto hidden = static_cast<int64_t>(multiplier * static_cast<double>(8 * dim / 3));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

// params.json's vocab_size, else (-1 in LLaMA 1 and 2) the rows of output.weight, which is split
// by rows across the files; 0 when neither says.
int64_t vocabulary(const Json& params, const storage::DiskMap& map) {
  if (const auto it = params.find("vocab_size"); it != params.end() && it->is_number_integer() && it->get<int64_t>() > 0)
    return it->get<int64_t>();
  int64_t rows = 0;
  for (const auto& shard : map.shards("output.weight")) rows += shard.shape.empty() ? 0 : shard.shape[0];
  return rows;
}

}  // namespace

std::string meta_params_json(const Json& params, const std::string& path, const storage::DiskMap& map,
                             bool rope_scaling_given) {
  for (const auto& [key, value] : params.items()) {
    const auto known = [&](const char* k) { return key == k; };
    if (std::none_of(std::begin(kKeys), std::end(kKeys), [&](const auto& p) { return known(p.first); }) &&
        std::none_of(std::begin(kOtherKeys), std::end(kOtherKeys), known))
      fail(path, "the key " + quote(key) + " is not one vramd reads from Meta's params.json and may change the model: "
                 "give a config.json beside the checkpoint instead");
  }
  Json config = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"tie_word_embeddings", false}};
  for (const auto& [theirs, ours] : kKeys)
    if (const auto it = params.find(theirs); it != params.end() && !it->is_null()) config[ours] = *it;
  // What is missing here, [arch] may give; the family names what neither does.
  if (!config.contains("intermediate_size") && params.contains("dim"))
    config["intermediate_size"] = intermediate_size(params, path);
  if (const int64_t vocab = vocabulary(params, map)) config["vocab_size"] = vocab;
  const auto scaled = params.find("use_scaled_rope");
  if (scaled != params.end() && !scaled->is_boolean())
    fail(path, "use_scaled_rope must be true or false, found " + scaled->dump());
  if (scaled != params.end() && scaled->get<bool>() && !rope_scaling_given)
    fail(path, "use_scaled_rope is set, and params.json does not say by what factor (8 in Llama 3.1, 32 in "
               "Llama 3.2): set rope_scaling in [arch], such as { rope_type = \"llama3\", factor = 8.0, "
               "low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position_embeddings = 8192 }");
  return config.dump();
}

}  // namespace vramd::hparams
