#include "family/switches.hpp"

#include <nlohmann/json.hpp>

#include "util/format.hpp"

namespace vramd::family {
namespace {

// docs/architectures.md describes each; model/engine.cpp and family/blueprint.cpp read them.
const std::vector<Switch>& table() {
  static const std::vector<Switch> switches = {
      // sizes
      {"hidden_size", Type::Integer, {}},
      {"num_layers", Type::Integer, {}},
      {"num_heads", Type::Integer, {}},
      {"num_kv_heads", Type::Integer, {}},
      {"head_dim", Type::Integer, {}},
      {"intermediate_size", Type::Integer, {}},
      {"vocab_size", Type::Integer, {}},
      {"max_positions", Type::Integer, {}},
      {"type_vocab_size", Type::Integer, {}},
      // norms
      {"norm", Type::String, {"rms", "layer"}},
      {"norm_eps", Type::Number, {}},
      {"norm_offset", Type::Number, {}},
      {"norm_in_float", Type::Boolean, {}},
      {"norm_bias", Type::Boolean, {}},
      // attention
      {"causal", Type::Boolean, {}},
      {"qkv_bias", Type::Boolean, {}},
      {"o_bias", Type::Boolean, {}},
      {"projections", Type::String, {"linear", "conv1d"}},
      {"qk_norm", Type::String, {"head", "full"}},
      {"attention_scale", Type::Number, {}},
      {"query_scale_dim", Type::Number, {}},
      {"scale_by_inverse_layer", Type::Boolean, {}},
      {"attention_softcap", Type::Number, {}},
      {"eager_attention", Type::Boolean, {}},
      {"clip_qkv", Type::Number, {}},
      {"sliding_window", Type::Integer, {}},
      {"layer_types", Type::Strings, {"full_attention", "sliding_attention"}},
      {"sliding_pattern", Type::Integer, {}},
      {"sliding_from_layer", Type::Integer, {}},
      // positions
      {"positions", Type::String, {"rope", "learned", "relative", "none"}},
      {"rope", Type::Object, {}},
      {"rope_theta", Type::Number, {}},
      {"rope_local_theta", Type::Number, {}},
      {"partial_rotary_factor", Type::Number, {}},
      {"rotary_in_float", Type::Boolean, {}},
      {"position_ids", Type::String, {"arange", "padding"}},
      {"pad_token_id", Type::Integer, {}},
      {"relative_buckets", Type::Integer, {}},
      {"relative_max_distance", Type::Integer, {}},
      // embeddings
      {"embed_scale", Type::String, {"none", "sqrt_hidden"}},
      // MLP
      {"mlp_gated", Type::Boolean, {}},
      {"activation", Type::String, {"gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu", "silu", "swish", "relu"}},
      {"mlp_bias", Type::Boolean, {}},
      // mixture of experts
      {"num_experts", Type::Integer, {}},
      {"experts_per_token", Type::Integer, {}},
      {"expert_intermediate_size", Type::Integer, {}},
      {"shared_expert_intermediate_size", Type::Integer, {}},
      {"norm_topk_prob", Type::Boolean, {}},
      {"router_weights_in_float", Type::Boolean, {}},
      {"sparse_step", Type::Integer, {}},
      {"dense_layers", Type::Integers, {}},
      // heads
      {"tie_word_embeddings", Type::Boolean, {}},
      {"final_softcap", Type::Number, {}},
      {"projection_dim", Type::Integer, {}},
      {"sentence_embedding", Type::Boolean, {}},
      {"pooling", Type::String, {"mean", "cls", "max"}},
      {"normalize", Type::Boolean, {}},
      {"pooled_token", Type::String, {"first", "eos"}},
      {"eos_token_id", Type::Integer, {}},
  };
  return switches;
}

}  // namespace

const Switch* find_switch(std::string_view name) {
  for (const auto& sw : table())
    if (name == sw.name) return &sw;
  return nullptr;
}

std::vector<std::string> switch_names() {
  std::vector<std::string> names;
  for (const auto& sw : table()) names.emplace_back(sw.name);
  return names;
}

std::vector<std::string> slot_names() {
  return {"layer",          "embed_tokens",    "embed_positions",         "embed_types",       "embed_norm",
          "relative_bias",  "final_norm",      "lm_head",                 "pooler",            "projection",
          "attention_norm", "attention_post_norm", "attention_residual_norm", "q",             "k",
          "v",              "qkv",             "o",                       "q_norm",            "k_norm",
          "mlp_norm",       "mlp_post_norm",   "mlp_residual_norm",       "gate",              "up",
          "gate_up",        "down",            "router",                  "expert",            "expert_gate",
          "expert_up",      "expert_down",     "shared_expert",           "shared_expert_gate"};
}

std::string type_text(const Switch& sw) {
  switch (sw.type) {
    case Type::Integer: return "an integer";
    case Type::Number: return "a number";
    case Type::Boolean: return "true or false";
    case Type::Integers: return "a list of integers";
    case Type::Object: return "a table";
    case Type::String:
    case Type::Strings: {
      if (sw.choices.empty()) return sw.type == Type::String ? "a string" : "a list of strings";
      std::string text = sw.type == Type::String ? "one of " : "a list of strings, each one of ";
      for (size_t i = 0; i < sw.choices.size(); ++i) text += (i ? ", " : "") + quote(sw.choices[i]);
      return text;
    }
  }
  return "?";
}

std::string type_problem(const Switch& sw, const nlohmann::json& value) {
  const auto allowed = [&](const nlohmann::json& item) {
    return item.is_string() && (sw.choices.empty() || std::find(sw.choices.begin(), sw.choices.end(),
                                                                item.get<std::string>()) != sw.choices.end());
  };
  bool fits = false;
  switch (sw.type) {
    case Type::Integer: fits = value.is_number_integer(); break;
    case Type::Number: fits = value.is_number(); break;
    case Type::Boolean: fits = value.is_boolean(); break;
    case Type::Integers:
      fits = value.is_array() && std::all_of(value.begin(), value.end(), [](const auto& item) { return item.is_number_integer(); });
      break;
    case Type::Object: fits = value.is_object(); break;
    case Type::String: fits = allowed(value); break;
    case Type::Strings: fits = value.is_array() && std::all_of(value.begin(), value.end(), allowed); break;
  }
  return fits ? "" : "expected " + type_text(sw) + ", found " + value.dump();
}

}  // namespace vramd::family
