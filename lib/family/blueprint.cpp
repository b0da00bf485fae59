#include "family/blueprint.hpp"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "family/switches.hpp"
#include "hparams/hyperparams.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::family {
namespace {

using Json = nlohmann::json;

// A JSON value as users wrote it, for messages and map lookups: a string without its quotes.
std::string text_of(const Json& value) { return value.is_string() ? value.get<std::string>() : value.dump(); }

class Resolver {
 public:
  Resolver(const Family& family, const hparams::Hyperparams& h) : family_(family), h_(h), values_(Json::parse(h.json())) {}

  // The switch's value for this checkpoint, typed and checked; nullopt when neither the
  // checkpoint nor the family gives one. `required`: the engine has no default either.
  std::optional<Json> get(const char* name, bool required = false) {
    const Switch& sw = *find_switch(name);
    auto it = family_.switches.find(name);
    if (it == family_.switches.end()) {
      if (required) fail(family_.origin, "the family does not set the switch " + quote(name) + ", which every model needs");
      return std::nullopt;
    }
    const SwitchSource& source = it->second;
    if (source.fixed) return Json::parse(*source.fixed);
    // A key present as null means "none" in transformers' configs (sliding_window: null): the
    // engine's default, not the family's fallback, which stands for the key's absence.
    bool null = false;
    if (!source.only_if.empty()) {
      auto condition = values_.find(source.only_if);
      null = condition == values_.end() || !condition->is_boolean() || !condition->get<bool>();
    }
    for (const auto& key : null ? std::vector<std::string>{} : source.keys) {
      auto found = values_.find(key);
      if (found == values_.end()) continue;
      if (found->is_null()) {
        null = true;
        continue;
      }
      Json value = *found;
      if (!source.mapped.empty()) {
        auto mapped = source.mapped.find(text_of(value));
        if (mapped == source.mapped.end()) {
          std::string known;
          for (const auto& [from, to] : source.mapped) known += (known.empty() ? "" : ", ") + quote(from);
          fail(h_.origin(), "hyperparameter " + quote(key) + " = " + value.dump() + " is not one family " +
                                quote(family_.name) + " computes (" + known + ")");
        }
        value = Json::parse(mapped->second);
      }
      const std::string problem = type_problem(sw, value);
      if (!problem.empty()) fail(h_.origin(), "hyperparameter " + quote(key) + ": " + problem);
      return value;
    }
    if (null) return std::nullopt;
    if (source.fallback) return Json::parse(*source.fallback);
    if (required || source.required) note_missing(sw, source.keys.front());
    return std::nullopt;
  }

  // The config.json key a switch is read from, for messages ("num_attention_heads").
  std::string key_of(const char* name) const {
    auto it = family_.switches.find(name);
    return it == family_.switches.end() || it->second.keys.empty() ? name : it->second.keys.front();
  }

  int64_t integer(const char* name, int64_t fallback) {
    auto value = get(name);
    return value ? value->get<int64_t>() : fallback;
  }
  int64_t integer(const char* name) {
    auto value = get(name, true);
    return value ? value->get<int64_t>() : 1;
  }
  double number(const char* name, double fallback) {
    auto value = get(name);
    return value ? value->get<double>() : fallback;
  }
  bool boolean(const char* name, bool fallback) {
    auto value = get(name);
    return value ? value->get<bool>() : fallback;
  }
  std::string string(const char* name, const std::string& fallback) {
    auto value = get(name);
    return value ? value->get<std::string>() : fallback;
  }

  // The family's [requires]: config values it cannot compute are refused, named.
  void check_requires() {
    for (const auto& [key, allowed] : family_.required_values) {
      auto found = values_.find(key);
      if (found == values_.end() || found->is_null()) continue;
      if (std::find(allowed.begin(), allowed.end(), found->dump()) != allowed.end()) continue;
      std::string known;
      for (const auto& value : allowed) known += (known.empty() ? "" : ", ") + value;
      fail(h_.origin(), "hyperparameter " + quote(key) + " = " + found->dump() + " is not supported by family " +
                            quote(family_.name) + " (it computes " + known + ")");
    }
  }

  // A config.json key no switch names, read as transformers reads it beside a switch.
  std::optional<int64_t> top_level_integer(const char* key) const {
    auto it = values_.find(key);
    if (it == values_.end() || it->is_null()) return std::nullopt;
    if (!it->is_number_integer()) fail(h_.origin(), "hyperparameter " + quote(key) + " must be an integer, found " + it->dump());
    return it->get<int64_t>();
  }

 private:
  // Through the collecting view, so that every missing key is named at once.
  void note_missing(const Switch& sw, const std::string& key) {
    if (sw.type == Type::Integer) h_.integer(key);
    else h_.number(key);
  }

  const Family& family_;
  const hparams::Hyperparams& h_;
  Json values_;
};

// Reads one rope table (transformers 5's rope_parameters, or an older rope_scaling with
// rope_theta beside it). `where` names it in messages.
// The pretraining context of llama3, yarn and longrope: config.json's own
// original_max_position_embeddings first (Phi-3 keeps it there), then the table's, then
// max_position_embeddings, as transformers takes it.
Rope read_rope(const Json& table, double theta, double partial, std::optional<int64_t> original, int64_t max_positions,
               const std::string& origin, const std::string& where) {
  Rope rope;
  rope.theta = theta;
  rope.partial = partial;
  const auto number = [&](const char* key, double fallback) {
    auto it = table.find(key);
    if (it == table.end() || it->is_null()) return fallback;
    if (!it->is_number()) fail(origin, "hyperparameter " + quote(where + "." + key) + " must be a number, found " + it->dump());
    return it->get<double>();
  };
  const auto required = [&](const char* key) {
    if (!table.contains(key) || table[key].is_null())
      fail(origin, "missing hyperparameter " + quote(where + "." + key) + " (a number, for rope type " + quote(rope.type) +
                       "; set it in config.json or [arch])");
    return number(key, 0);
  };
  const auto factors = [&](const char* key) {
    std::vector<double> out;
    auto it = table.find(key);
    if (it == table.end() || !it->is_array() || !std::all_of(it->begin(), it->end(), [](const Json& v) { return v.is_number(); }))
      fail(origin, "hyperparameter " + quote(where + "." + key) + " must be a list of numbers for rope type " + quote(rope.type));
    for (const auto& v : *it) out.push_back(v.get<double>());
    return out;
  };
  for (const char* key : {"rope_type", "type"}) {
    auto it = table.find(key);
    if (it == table.end() || it->is_null()) continue;
    if (!it->is_string()) fail(origin, "hyperparameter " + quote(where + "." + key) + " must be a string, found " + it->dump());
    rope.type = it->get<std::string>();
    break;
  }
  if (rope.type == "su") rope.type = "longrope";  // its name before transformers 4.45
  static const std::vector<std::string> kTypes = {"default", "linear", "llama3", "yarn", "longrope"};
  if (std::find(kTypes.begin(), kTypes.end(), rope.type) == kTypes.end())
    fail(origin, "hyperparameter " + quote(where + ".rope_type") + " = " + quote(rope.type) +
                     " is not supported (default, linear, llama3, yarn, longrope)");
  rope.theta = number("rope_theta", rope.theta);
  rope.partial = number("partial_rotary_factor", rope.partial);
  if (rope.type == "default") return rope;
  rope.original_max_positions =
      original.value_or(static_cast<int64_t>(number("original_max_position_embeddings", static_cast<double>(max_positions))));
  if (rope.type == "linear") {
    rope.factor = required("factor");
  } else if (rope.type == "llama3") {
    rope.factor = required("factor");
    rope.low_freq_factor = required("low_freq_factor");
    rope.high_freq_factor = required("high_freq_factor");
  } else if (rope.type == "yarn") {
    rope.factor = required("factor");
    rope.beta_fast = number("beta_fast", 32);
    rope.beta_slow = number("beta_slow", 1);
    if (table.contains("attention_factor") && !table["attention_factor"].is_null()) rope.attention_factor = number("attention_factor", 1);
    if (table.contains("mscale") && !table["mscale"].is_null()) rope.mscale = number("mscale", 1);
    if (table.contains("mscale_all_dim") && !table["mscale_all_dim"].is_null()) rope.mscale_all_dim = number("mscale_all_dim", 0);
    if (table.contains("truncate")) {
      if (!table["truncate"].is_boolean()) fail(origin, "hyperparameter " + quote(where + ".truncate") + " must be true or false");
      rope.truncate = table["truncate"].get<bool>();
    }
  } else {  // longrope
    rope.short_factor = factors("short_factor");
    rope.long_factor = factors("long_factor");
    if (table.contains("attention_factor") && !table["attention_factor"].is_null()) rope.attention_factor = number("attention_factor", 1);
    rope.factor_given = table.contains("factor") && !table["factor"].is_null();
    rope.factor = number("factor", 1);
  }
  if (rope.type != "linear" && rope.original_max_positions <= 0)
    fail(origin, "rope type " + quote(rope.type) + " needs original_max_position_embeddings or max_position_embeddings");
  return rope;
}

// A layer's or an expert's module: each `placeholder` ("{i}", "{e}") in the family's name
// replaced by its number.
std::string numbered(const std::string& name, std::string_view placeholder, int64_t index) {
  std::string path = name;
  const std::string number = std::to_string(index);
  for (auto at = path.find(placeholder); at != std::string::npos; at = path.find(placeholder, at + number.size()))
    path.replace(at, placeholder.size(), number);
  return path;
}

}  // namespace

Blueprint resolve(const Family& family, const hparams::Hyperparams& hyperparams, const std::vector<std::string>& tensor_names) {
  Resolver r(family, hyperparams);
  r.check_requires();
  Blueprint b;
  b.family = family.name;
  b.origin = hyperparams.origin();
  b.base_prefix = family.base_prefix;
  b.ignored = family.ignored;
  const std::string& origin = hyperparams.origin();
  const auto require = [&](bool holds, const std::string& message) { hyperparams.require(holds, message); };

  b.hidden = r.integer("hidden_size");
  b.layers = r.integer("num_layers");
  b.heads = r.integer("num_heads");
  b.kv_heads = r.integer("num_kv_heads", b.heads);
  b.vocabulary = r.integer("vocab_size");
  require(b.heads > 0 && b.kv_heads > 0 && b.heads % b.kv_heads == 0,
          r.key_of("num_heads") + " (" + std::to_string(b.heads) + ") must be a positive multiple of " +
              r.key_of("num_kv_heads") + " (" + std::to_string(b.kv_heads) + ")");
  require(b.hidden > 0 && b.layers >= 0 && b.vocabulary > 0,
          r.key_of("hidden_size") + ", " + r.key_of("num_layers") + " and " + r.key_of("vocab_size") + " must be positive");
  const bool explicit_head_dim = r.get("head_dim").has_value();
  b.head_dim = r.integer("head_dim", b.heads > 0 ? b.hidden / b.heads : 0);
  if (!explicit_head_dim)
    require(b.heads > 0 && b.hidden % b.heads == 0, r.key_of("hidden_size") + " (" + std::to_string(b.hidden) +
                                                        ") must be a multiple of " + r.key_of("num_heads") + " (" +
                                                        std::to_string(b.heads) + ")");
  b.intermediate = r.integer("intermediate_size", 4 * b.hidden);
  const bool learned = r.string("positions", "rope") == "learned";  // the embedding's size: required
  b.max_positions = learned ? r.integer("max_positions") : r.integer("max_positions", 0);
  b.max_positions_key = r.key_of("max_positions");
  b.type_vocabulary = r.integer("type_vocab_size", 2);

  b.norm = r.string("norm", "rms") == "rms" ? NormKind::Rms : NormKind::Layer;
  b.norm_eps = r.number("norm_eps", 1e-5);
  b.norm_offset = r.number("norm_offset", 0);
  b.norm_in_float = r.boolean("norm_in_float", false);
  b.norm_bias = r.boolean("norm_bias", true);

  b.causal = r.boolean("causal", true);
  b.qkv_bias = r.boolean("qkv_bias", false);
  b.o_bias = r.boolean("o_bias", false);
  b.full_qk_norm = r.string("qk_norm", "head") == "full";
  b.conv1d = r.string("projections", "linear") == "conv1d";
  b.rotary_in_float = r.boolean("rotary_in_float", false);
  const double scale_dim = r.number("query_scale_dim", static_cast<double>(b.head_dim));
  require(scale_dim > 0, "the attention's scaling dimension must be positive");
  b.attention_scale = r.number("attention_scale", 0);
  if (b.attention_scale == 0 && scale_dim > 0) b.attention_scale = 1.0 / std::sqrt(scale_dim);
  b.scale_by_inverse_layer = r.boolean("scale_by_inverse_layer", false);
  b.attention_softcap = r.number("attention_softcap", 0);
  b.eager_attention = r.boolean("eager_attention", false) || b.attention_softcap > 0;

  b.sliding_window = r.integer("sliding_window", 0);
  b.sliding.assign(static_cast<size_t>(std::max<int64_t>(b.layers, 0)), 0);
  if (auto types = r.get("layer_types")) {
    if (static_cast<int64_t>(types->size()) != b.layers)
      fail(origin, "hyperparameter layer_types has " + std::to_string(types->size()) + " entries for " +
                       std::to_string(b.layers) + " layers");
    for (size_t i = 0; i < types->size(); ++i) b.sliding[i] = (*types)[i] == "sliding_attention";
  } else if (const int64_t pattern = r.integer("sliding_pattern", 0); pattern > 0) {
    for (int64_t i = 0; i < b.layers; ++i) b.sliding[i] = (i + 1) % pattern != 0;
  } else if (auto first = r.get("sliding_from_layer"); first && b.sliding_window > 0) {
    for (int64_t i = first->get<int64_t>(); i < b.layers; ++i) b.sliding[i] = 1;
  } else {
    std::fill(b.sliding.begin(), b.sliding.end(), b.sliding_window > 0);
  }
  // A sliding layer without a window attends to everything, as transformers runs it (Qwen2's
  // layer_types with use_sliding_window off).
  if (b.sliding_window <= 0) std::fill(b.sliding.begin(), b.sliding.end(), 0);

  const std::string positions = r.string("positions", "rope");
  b.positions = positions == "rope" ? Positions::Rope : positions == "learned" ? Positions::Learned
              : positions == "relative" ? Positions::Relative : Positions::None;
  if (b.positions == Positions::Rope) {
    const double theta = r.number("rope_theta", 10000.0);
    const double partial = r.number("partial_rotary_factor", 1.0);
    const Json table = r.get("rope").value_or(Json::object());
    const bool per_layer_type = table.contains("full_attention") || table.contains("sliding_attention");
    const auto part = [&](const char* type) {
      auto it = table.find(type);
      return it != table.end() && it->is_object() ? *it : Json::object();
    };
    const auto original = r.top_level_integer("original_max_position_embeddings");
    b.rope = read_rope(per_layer_type ? part("full_attention") : table, theta, partial, original, b.max_positions, origin,
                       per_layer_type ? "rope_parameters.full_attention" : "rope_parameters");
    b.local_rope = per_layer_type ? read_rope(part("sliding_attention"), theta, partial, original, b.max_positions, origin,
                                              "rope_parameters.sliding_attention")
                                  : b.rope;
    const size_t factors = b.rope.short_factor.size();
    const int64_t rotary_half = static_cast<int64_t>(static_cast<double>(b.head_dim) * b.rope.partial) / 2;
    if (b.rope.type == "longrope" && (static_cast<int64_t>(factors) != rotary_half || b.rope.long_factor.size() != factors))
      fail(origin, "rope_parameters.short_factor and long_factor must each hold " + std::to_string(rotary_half) +
                       " numbers (half the rotary dimensions), found " + std::to_string(factors) + " and " +
                       std::to_string(b.rope.long_factor.size()));
    if (auto local = r.get("rope_local_theta"); local && !per_layer_type) {
      b.local_rope = Rope{};
      b.local_rope.theta = local->get<double>();
      b.local_rope.partial = b.rope.partial;
    }
    const int64_t rotary = static_cast<int64_t>(static_cast<double>(b.head_dim) * b.rope.partial);
    require(rotary > 0 && rotary % 2 == 0 && rotary <= b.head_dim,
            "the rotary dimensions (head_dim " + std::to_string(b.head_dim) + " times partial_rotary_factor) must be even and positive");
  }
  b.padding_positions = r.string("position_ids", "arange") == "padding";
  b.pad_token = r.integer("pad_token_id", 1);
  b.relative_buckets = r.integer("relative_buckets", 32);
  b.relative_max_distance = r.integer("relative_max_distance", 128);

  // Sizes a model can have: no 0-width layer, no model that would not fit any memory.
  const auto within = [&](const char* name, int64_t value, int64_t low, int64_t high) {
    require(value >= low && value <= high, r.key_of(name) + " (" + std::to_string(value) + ") must be in [" +
                                               std::to_string(low) + ", " + std::to_string(high) + "]");
  };
  constexpr int64_t kMaxWidth = int64_t{1} << 24, kMaxLayers = 100'000;
  within("hidden_size", b.hidden, 1, kMaxWidth);
  within("num_layers", b.layers, 0, kMaxLayers);
  within("head_dim", b.head_dim, 1, kMaxWidth);
  within("intermediate_size", b.intermediate, 1, kMaxWidth * 16);
  within("vocab_size", b.vocabulary, 1, int64_t{1} << 31);
  within("max_positions", b.max_positions, learned ? 1 : 0, int64_t{1} << 31);
  within("sliding_window", b.sliding_window, 0, int64_t{1} << 40);
  within("type_vocab_size", b.type_vocabulary, 1, kMaxWidth);
  if (b.padding_positions) within("pad_token_id", b.pad_token, 0, b.max_positions - 2);
  if (b.positions == Positions::Relative) {
    within("relative_buckets", b.relative_buckets, 4, 1 << 16);
    within("relative_max_distance", b.relative_max_distance, b.relative_buckets / 4 + 1, int64_t{1} << 40);
  }

  b.embed_scale_sqrt_hidden = r.string("embed_scale", "none") == "sqrt_hidden";
  b.mlp_gated = r.boolean("mlp_gated", true);
  b.activation = r.string("activation", "silu");
  b.mlp_bias = r.boolean("mlp_bias", false);

  b.clip_qkv = r.number("clip_qkv", 0);
  require(b.clip_qkv >= 0, r.key_of("clip_qkv") + " must not be negative");
  b.experts = r.integer("num_experts", 0);
  b.sparse.assign(static_cast<size_t>(std::max<int64_t>(b.layers, 0)), 0);
  if (b.experts > 0) {
    b.experts_per_token = r.integer("experts_per_token");
    b.expert_intermediate = r.integer("expert_intermediate_size");
    b.shared_intermediate = r.integer("shared_expert_intermediate_size", 0);
    b.norm_topk_prob = r.boolean("norm_topk_prob", false);
    b.router_weights_in_float = r.boolean("router_weights_in_float", false);
    within("num_experts", b.experts, 1, 1 << 16);
    within("experts_per_token", b.experts_per_token, 1, b.experts);
    within("expert_intermediate_size", b.expert_intermediate, 1, kMaxWidth * 16);
    within("shared_expert_intermediate_size", b.shared_intermediate, 0, kMaxWidth * 16);
    // transformers' Qwen2-MoE: layer i is sparse unless mlp_only_layers lists it, every
    // decoder_sparse_step-th layer counting from 1.
    const int64_t step = r.integer("sparse_step", 1);
    within("sparse_step", step, 1, kMaxLayers);
    std::vector<int64_t> dense;
    if (auto listed = r.get("dense_layers")) dense = listed->get<std::vector<int64_t>>();
    for (int64_t i = 0; i < b.layers; ++i)
      b.sparse[i] = (i + 1) % step == 0 && std::find(dense.begin(), dense.end(), i) == dense.end();
  }

  b.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  b.projection_dim = r.integer("projection_dim", b.hidden);
  within("projection_dim", b.projection_dim, 1, kMaxWidth);
  b.final_softcap = r.number("final_softcap", 0);
  b.sentence_embedding = r.boolean("sentence_embedding", false);
  b.pooling = r.string("pooling", "mean");
  b.normalize = r.boolean("normalize", false);
  b.pool_eos = r.string("pooled_token", "first") == "eos";
  b.eos_token = r.integer("eos_token_id", 2);

  // Names: a slot is present when the family names it (an optional one when the checkpoint
  // holds its weight as well).
  const auto named = [&](const char* slot) -> std::string {
    auto it = family.names.find(slot);
    if (it == family.names.end()) return "";
    const NameSource& name = it->second;
    return name.condition.empty() || r.boolean(name.condition.c_str(), false) ? name.name : name.otherwise;
  };
  const auto holds = [&](const std::string& path) {
    const std::string weight = path + ".weight";
    return std::any_of(tensor_names.begin(), tensor_names.end(), [&](const std::string& tensor) {
      return tensor == weight || (!b.base_prefix.empty() && (tensor == b.base_prefix + weight ||
                                                             (weight.starts_with(b.base_prefix) && tensor == weight.substr(b.base_prefix.size()))));
    });
  };
  const auto global = [&](const char* slot) {
    std::string path = named(slot);
    const bool optional = std::find(family.optional.begin(), family.optional.end(), slot) != family.optional.end();
    return optional && !holds(path) ? std::string() : path;
  };
  // The family's order first, then the slots it leaves out in the usual order.
  b.embedding_order = family.embedding_order;
  for (const auto& slot : kEmbeddingSlots)
    if (std::find(b.embedding_order.begin(), b.embedding_order.end(), slot) == b.embedding_order.end())
      b.embedding_order.push_back(slot);
  b.embed_tokens = global("embed_tokens");
  b.embed_positions = global("embed_positions");
  b.embed_types = global("embed_types");
  b.embed_norm = global("embed_norm");
  b.relative_bias = global("relative_bias");
  b.final_norm = global("final_norm");
  b.lm_head = global("lm_head");
  b.pooler = global("pooler");
  b.projection = global("projection");
  if (b.embed_tokens.empty()) fail(family.origin, "names.embed_tokens: missing (every model reads tokens)");
  // A head the checkpoint holds is its own, tied or not, as transformers loads it.
  if (!b.lm_head.empty() && holds(b.lm_head)) b.tie_word_embeddings = false;
  if (b.positions == Positions::Learned && b.embed_positions.empty())
    fail(family.origin, "positions = \"learned\" needs names.embed_positions");
  if (b.positions == Positions::Relative && b.relative_bias.empty())
    fail(family.origin, "positions = \"relative\" needs names.relative_bias");

  const std::string layer = named("layer");
  // An expert's module, and its projections within it.
  const std::string expert = named("expert");
  const ExpertNames projection{named("expert_gate"), named("expert_up"), named("expert_down")};
  const auto projections = [&](const std::string& module) {
    return ExpertNames{module + "." + projection.gate, module + "." + projection.up, module + "." + projection.down};
  };
  for (int64_t i = 0; i < b.layers; ++i) {
    const std::string prefix = numbered(layer, "{i}", i) + ".";
    const auto in_block = [&](const char* slot) {
      const std::string name = named(slot);
      return name.empty() ? name : prefix + name;
    };
    BlockNames n;
    n.attention_norm = in_block("attention_norm");
    n.attention_post_norm = in_block("attention_post_norm");
    n.attention_residual_norm = in_block("attention_residual_norm");
    n.q = in_block("q");
    n.k = in_block("k");
    n.v = in_block("v");
    n.qkv = in_block("qkv");
    n.o = in_block("o");
    n.q_norm = in_block("q_norm");
    n.k_norm = in_block("k_norm");
    n.mlp_norm = in_block("mlp_norm");
    n.mlp_post_norm = in_block("mlp_post_norm");
    n.mlp_residual_norm = in_block("mlp_residual_norm");
    if (b.sparse[i]) {
      n.router = in_block("router");
      if (n.router.empty() || expert.empty() || projection.gate.empty() || projection.up.empty() || projection.down.empty())
        fail(family.origin, "names: a mixture of experts (num_experts) needs router, expert, expert_gate, expert_up and expert_down");
      for (int64_t e = 0; e < b.experts; ++e) n.experts.push_back(projections(prefix + numbered(expert, "{e}", e)));
      if (b.shared_intermediate > 0) {
        const std::string shared = in_block("shared_expert");
        if (shared.empty())
          fail(family.origin, "names: a shared expert (shared_expert_intermediate_size) needs shared_expert");
        n.shared_expert = projections(shared);
        n.shared_expert_gate = in_block("shared_expert_gate");
      }
    } else {
      n.gate = in_block("gate");
      n.up = in_block("up");
      n.gate_up = in_block("gate_up");
      n.down = in_block("down");
      if (n.down.empty()) fail(family.origin, "names: down is needed");
      if (n.gate_up.empty() && n.up.empty()) fail(family.origin, "names: give up, or the fused gate_up");
      if (b.mlp_gated && n.gate_up.empty() && n.gate.empty())
        fail(family.origin, "names: a gated MLP (mlp_gated) needs gate, or the fused gate_up");
    }
    if (i == 0) {
      if (n.qkv.empty() && (n.q.empty() || n.k.empty() || n.v.empty()))
        fail(family.origin, "names: give q, k and v, or the fused qkv");
      if (n.o.empty()) fail(family.origin, "names: o is needed");
      if (n.q_norm.empty() != n.k_norm.empty()) fail(family.origin, "names: q_norm and k_norm go together");
    }
    b.blocks.push_back(std::move(n));
  }
  return b;
}

}  // namespace vramd::family
