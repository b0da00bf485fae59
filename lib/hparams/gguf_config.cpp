#include "hparams/gguf_config.hpp"

#include <algorithm>
#include <iterator>
#include <nlohmann/json.hpp>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::hparams {
namespace {

using Json = nlohmann::json;

// llama.cpp's keys, less the architecture's prefix, to Hugging Face's.
constexpr std::pair<const char*, const char*> kKeys[] = {
    {"context_length", "max_position_embeddings"},
    {"embedding_length", "hidden_size"},
    {"feed_forward_length", "intermediate_size"},
    {"block_count", "num_hidden_layers"},
    {"attention.head_count", "num_attention_heads"},
    {"attention.head_count_kv", "num_key_value_heads"},
    {"attention.layer_norm_rms_epsilon", "rms_norm_eps"},
    {"attention.key_length", "head_dim"},
    {"rope.freq_base", "rope_theta"},
    {"vocab_size", "vocab_size"},
};
// Keys only some architectures read: the families that attend within a window or soft-cap.
struct ArchitectureKey {
  const char* architecture;
  const char* ours;
  const char* theirs;
};
constexpr ArchitectureKey kArchitectureKeys[] = {
    {"phi3", "attention.sliding_window", "sliding_window"},
    {"gemma2", "attention.sliding_window", "sliding_window"},
    {"gemma2", "attn_logit_softcapping", "attn_logit_softcapping"},
    {"gemma2", "final_logit_softcapping", "final_logit_softcapping"},
    {"gemma3", "attention.sliding_window", "sliding_window"},
    // Mixtures of experts: a llama file with experts is a Mixtral.
    {"llama", "expert_count", "num_local_experts"},
    {"llama", "expert_used_count", "num_experts_per_tok"},
    {"qwen2moe", "expert_count", "num_experts"},
    {"qwen2moe", "expert_used_count", "num_experts_per_tok"},
    {"qwen2moe", "expert_feed_forward_length", "moe_intermediate_size"},
    {"qwen2moe", "expert_shared_feed_forward_length", "shared_expert_intermediate_size"},
    {"qwen3moe", "expert_count", "num_experts"},
    {"qwen3moe", "expert_used_count", "num_experts_per_tok"},
    {"qwen3moe", "expert_feed_forward_length", "moe_intermediate_size"},
    {"olmoe", "expert_count", "num_experts"},  // its experts' size is feed_forward_length, as in config.json
    {"olmoe", "expert_used_count", "num_experts_per_tok"},
};
// Read to check, not copied: they must agree with the rest.
constexpr const char* kChecked[] = {"attention.value_length", "rope.dimension_count"};
// llama.cpp's architecture, and the model_type of the family that computes it.
constexpr std::pair<const char*, const char*> kArchitectures[] = {
    {"llama", "llama"}, {"qwen2", "qwen2"}, {"qwen3", "qwen3"}, {"phi3", "phi3"}, {"gemma2", "gemma2"},
    {"gemma3", "gemma3_text"},  // a GGUF file of Gemma 3 holds its text model alone
    {"qwen2moe", "qwen2_moe"}, {"qwen3moe", "qwen3_moe"}, {"olmoe", "olmoe"},
};

}  // namespace

std::string gguf_config_json(const storage::DiskMap& map) {
  const auto& file = map.files()[0];
  Json metadata = Json::object();
  for (const auto& [key, value] : file.metadata) metadata[key] = Json::parse(value);
  const auto refuse = [&](const std::string& why) -> void { fail(file.path, why); };
  if (!metadata.contains("general.architecture") || !metadata["general.architecture"].is_string())
    refuse("GGUF metadata has no general.architecture string");
  const std::string architecture = metadata["general.architecture"];
  const auto* runs = std::find_if(std::begin(kArchitectures), std::end(kArchitectures),
                                  [&](const auto& entry) { return architecture == entry.first; });
  if (runs == std::end(kArchitectures))
    refuse("GGUF architecture " + quote(architecture) + " is not run from GGUF yet (llama and Mixtral, qwen2, qwen3, "
           "phi3, gemma2, gemma3, qwen2moe, qwen3moe, olmoe are)");

  Json config = {{"model_type", runs->second}};
  Json checked = Json::object();
  const std::string prefix = architecture + ".";
  for (const auto& [key, value] : metadata.items()) {
    if (!key.starts_with(prefix)) continue;
    const std::string name = key.substr(prefix.size());
    bool known = false;
    for (const auto& [ours, theirs] : kKeys)
      if (name == ours) config[theirs] = value, known = true;
    for (const auto& key : kArchitectureKeys)
      if (architecture == key.architecture && name == key.ours) config[key.theirs] = value, known = true;
    for (const char* ours : kChecked)
      if (name == ours) checked[ours] = value, known = true;
    if (!known) refuse("GGUF key " + quote(key) + " is not read by vramd, and a model that ignored it could compute "
                       "something else; the keys read are those of plain " + architecture + " models");
  }
  for (const char* required : {"hidden_size", "num_attention_heads", "num_hidden_layers"})
    if (!config.contains(required) || !config[required].is_number_unsigned() || config[required] == 0)
      refuse("GGUF metadata lacks a positive " + prefix + " key for " + required);
  if (config.contains("head_dim") && (!config["head_dim"].is_number_unsigned() || config["head_dim"] == 0))
    refuse("GGUF key " + quote(prefix + "attention.key_length") + " is " + config["head_dim"].dump() +
           ", not a positive head size");
  const uint64_t heads = config["num_attention_heads"];
  const uint64_t head_dim = config.contains("head_dim") ? config["head_dim"].get<uint64_t>()
                                                        : config["hidden_size"].get<uint64_t>() / heads;
  for (const auto& [name, value] : checked.items())
    if (value != head_dim)
      refuse("GGUF key " + quote(prefix + name) + " is " + value.dump() + ", not the head size " +
             std::to_string(head_dim) + ": partial rotary and uneven value heads are not read");
  if (!config.contains("vocab_size"))
    if (const auto* embedding = map.find("token_embd.weight"); embedding && !embedding->shape.empty())
      config["vocab_size"] = embedding->shape[0];
  config["tie_word_embeddings"] = map.find("output.weight") == nullptr;
  // llama.cpp's Mixtral is a llama file with experts, its routing renormalised (the family's
  // own); Qwen3-MoE's llama.cpp renormalises too, which its config.json says with
  // norm_topk_prob; Qwen2-MoE's and OLMoE's do not, as their configs' default.
  if (architecture == "llama" && config.contains("num_local_experts")) config["model_type"] = "mixtral";
  if (architecture == "qwen3moe") config["norm_topk_prob"] = true;
  return config.dump();
}

}  // namespace vramd::hparams
