#include "load/lora.hpp"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "convert/converter.hpp"
#include "storage/disk_map.hpp"
#include "storage/tensor_io.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "weights/weights.hpp"

namespace vramd::load {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;  // rank_pattern's first match wins, in the file's order
using model::Parameter;

namespace {

// What a PEFT folder's adapter_config.json says; a plain file has none.
struct PeftConfig {
  int64_t r = 0;
  double alpha = 0;
  bool rslora = false;
  json rank_pattern = json::object(), alpha_pattern = json::object(), target_modules;
};

// One module's pair of factors, as the file names them.
struct Pair {
  std::string down_key, up_key, alpha_key;
  bool embedding = false;
};

// Which part of a module's adapter a key holds, by its suffix.
struct Suffix {
  const char* text;
  enum { Down, Up, Alpha, EmbeddingDown, EmbeddingUp } part;
};
constexpr Suffix kSuffixes[] = {
    {".lora_A.weight", Suffix::Down},       {".lora_B.weight", Suffix::Up},
    {".lora_down.weight", Suffix::Down},    {".lora_up.weight", Suffix::Up},
    {".lora.down.weight", Suffix::Down},    {".lora.up.weight", Suffix::Up},
    {".lora_embedding_A", Suffix::EmbeddingDown}, {".lora_embedding_B", Suffix::EmbeddingUp},
    {".alpha", Suffix::Alpha},
};

// Keys of adapters vramd does not apply, and what they are.
std::optional<std::string> refused_format(std::string_view key) {
  const auto has = [&](std::string_view part) { return key.find(part) != std::string_view::npos; };
  if (has("lora_magnitude_vector") || has(".dora_scale")) return "DoRA (a magnitude vector beside the LoRA factors)";
  if (has(".hada_w")) return "LoHa (Hadamard-product factors, hada_w1_a...)";
  if (has(".lokr_w")) return "LoKr (Kronecker-product factors, lokr_w1...)";
  if (has(".lora_B.bias") || has(".lora_up.bias")) return "a LoRA with a bias (lora_bias = true)";
  if (key.ends_with(".diff") || key.ends_with(".diff_b")) return "a full weight difference (.diff)";
  if (has(".base_layer.")) return "a whole weight saved beside the adapter (peft's save_embedding_layers: save with save_embedding_layers=False)";
  return std::nullopt;
}

// peft's get_pattern_key: the first pattern that matches the end of the module's name at a dot.
const json* pattern_for(const json& patterns, const std::string& module) {
  for (const auto& [pattern, value] : patterns.items()) {
    try {
      if (std::regex_match(module, std::regex("(.*\\.)?(" + pattern + ")"))) return &value;
    } catch (const std::regex_error&) {
      throw BadAdapter("pattern " + quote(pattern) + " is no regular expression");
    }
  }
  return nullptr;
}

// Whether PEFT's target_modules names the module: a list of names matched at its end after a
// dot (or whole), a string matched whole as a regular expression, or "all-linear".
bool targeted(const json& targets, const std::string& module) {
  if (targets.is_null()) return true;
  if (targets.is_string()) {
    const std::string text = targets.get<std::string>();
    try {
      return text == "all-linear" || std::regex_match(module, std::regex(text));
    } catch (const std::regex_error&) {
      throw BadAdapter("target_modules " + quote(text) + " is no regular expression");
    }
  }
  for (const auto& target : targets) {
    const std::string name = target.get<std::string>();
    if (module == name || module.ends_with("." + name)) return true;
  }
  return false;
}

PeftConfig read_peft_config(const std::string& path) {
  json j;
  try {
    j = json::parse(read_regular_file(path, 16 << 20));
  } catch (const json::exception& e) {
    throw BadAdapter(path + ": not JSON: " + e.what());
  }
  const std::string type = j.value("peft_type", "LORA");
  if (type != "LORA")
    throw BadAdapter(path + ": peft_type " + quote(type) + " is not supported: vramd applies LoRA adapters" +
                     (type == "LOHA" ? " (LoHa's Hadamard products are refused)" : type == "LOKR" ? " (LoKr's Kronecker products are refused)" : ""));
  if (j.value("use_dora", false)) throw BadAdapter(path + ": use_dora = true: DoRA is not supported, only LoRA");
  if (j.contains("lora_bias") && j["lora_bias"].is_boolean() && j["lora_bias"].get<bool>())
    throw BadAdapter(path + ": lora_bias = true: a LoRA with a bias is not supported");
  PeftConfig config;
  try {
    config.r = j.at("r").get<int64_t>();
    config.alpha = j.contains("lora_alpha") ? j["lora_alpha"].get<double>() : static_cast<double>(config.r);
    config.rslora = j.value("use_rslora", false);
    if (j.contains("rank_pattern") && j["rank_pattern"].is_object()) config.rank_pattern = j["rank_pattern"];
    if (j.contains("alpha_pattern") && j["alpha_pattern"].is_object()) config.alpha_pattern = j["alpha_pattern"];
    if (j.contains("target_modules")) config.target_modules = j["target_modules"];
  } catch (const json::exception& e) {
    throw BadAdapter(path + ": " + e.what());
  }
  if (config.r <= 0) throw BadAdapter(path + ": r = " + std::to_string(config.r) + " is no rank");
  return config;
}

// The adapter's index and, for a PEFT folder, its config.
std::pair<storage::DiskMap, std::optional<PeftConfig>> open_adapter(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error)) {
    const fs::path folder(path);
    if (!fs::exists(folder / "adapter_config.json"))
      throw BadAdapter(path + ": a folder without adapter_config.json is no PEFT adapter");
    std::string file;
    for (const char* name : {"adapter_model.safetensors", "adapter_model.bin"})
      if (fs::exists(folder / name)) {
        file = (folder / name).string();
        break;
      }
    if (file.empty()) throw BadAdapter(path + ": no adapter_model.safetensors (or .bin) beside its adapter_config.json");
    auto config = read_peft_config((folder / "adapter_config.json").string());
    try {
      return {storage::DiskMap::open(file), config};
    } catch (const Error& e) {
      throw BadAdapter(e.what());
    }
  }
  if (!fs::exists(path, error)) throw BadAdapter(path + ": no such file or folder");
  try {
    return {storage::DiskMap::open(path), std::nullopt};
  } catch (const Error& e) {
    throw BadAdapter(e.what());
  }
}

// A kohya module name, "lora_unet_down_blocks_0_...", as its component ("lora_unet", "lora_te1")
// and the rest ("down_blocks_0_...", the module's name with dots as underscores).
std::pair<std::string, std::string> kohya_parts(const std::string& module) {
  const size_t second = module.find('_', module.find('_') + 1);
  if (second == std::string::npos) return {module, module};
  return {module.substr(0, second), module.substr(second + 1)};
}

// The component a key's module belongs to in a file for several models: kohya's prefix or
// diffusers' first name ("unet", "text_encoder").
std::string component_of(const std::string& module, bool kohya) {
  return kohya ? kohya_parts(module).first : module.substr(0, module.find('.'));
}

// The model's weights by module name, dots as underscores, for kohya's names.
std::map<std::string, Parameter*> by_underscored(model::Model& model) {
  std::map<std::string, Parameter*> out;
  for (Parameter* parameter : model.parameters()) {
    if (!parameter->name.ends_with(".weight")) continue;
    std::string name = parameter->name.substr(0, parameter->name.size() - 7);
    std::replace(name.begin(), name.end(), '.', '_');
    out.emplace(name, parameter);
  }
  return out;
}

// The layer's own weight (its path's "weight"), or null.
const Parameter* weight_of(const model::Layer& layer) {
  for (const Parameter& parameter : layer.parameters())
    if (parameter.name == layer.path() + ".weight") return &parameter;
  return nullptr;
}

std::string shape_of(const at::Tensor& tensor) { return format_shape(tensor.sizes().vec()); }

// A checkpoint tensor's stored shape and the weights whose expressions read it.
struct SourceReaders {
  std::vector<int64_t> shape;
  bool sharded = false;  // split across files: read in slices
  std::vector<Parameter*> parameters;
};

}  // namespace

Applied applied(const config::ModelConfig& config) {
  if (config.fuse_lora) return Applied::Fused;
  return config::clients_apply_adapters(config) ? Applied::ByClients : Applied::Unfused;
}

LoraSet read_loras(const std::vector<config::LoraConfig>& loras, model::Model& model,
                   const std::vector<weights::Assignment>& assignments, Applied applied,
                   const std::function<std::string(size_t)>& where_of) {
  LoraSet set;
  std::set<const Parameter*> assigned;
  for (const auto& assignment : assignments) assigned.insert(assignment.parameter);
  std::map<const Parameter*, weights::Patch> patches;
  std::map<std::string, Parameter*> underscored;
  std::map<const Parameter*, const model::Layer*> layer_of;
  for (const auto& layer : model.layers())
    for (const Parameter& parameter : layer->parameters()) layer_of[&parameter] = layer.get();
  std::vector<std::string> all_names;
  for (const Parameter* parameter : model.parameters()) all_names.push_back(parameter->name);
  // The checkpoint's tensors and the weights whose expressions read them, for adapters that name
  // the checkpoint's modules where a converter stacks or joins them (made when first needed).
  std::map<std::string, SourceReaders> reads_of;
  const auto readers_of = [&](const std::string& key) -> const SourceReaders* {
    if (reads_of.empty())
      for (const auto& assignment : assignments)
        assignment.expr->for_each_source([&](const convert::Expr& s) {
          SourceReaders& readers = reads_of[s.source];
          readers.shape = s.shape;
          readers.sharded = readers.sharded || s.shards != 1;
          if (std::find(readers.parameters.begin(), readers.parameters.end(), assignment.parameter) == readers.parameters.end())
            readers.parameters.push_back(assignment.parameter);
        });
    const auto it = reads_of.find(key);
    return it == reads_of.end() ? nullptr : &it->second;
  };

  for (size_t index = 0; index < loras.size(); ++index) {
    const auto& lora = loras[index];
    const std::string where = where_of(index) + ", " + lora.path;
    try {
      auto [map, peft] = open_adapter(lora.path);
      // The keys, module by module.
      std::map<std::string, Pair> pairs;
      bool kohya = false;
      for (const auto& info : map.tensors()) {
        const std::string key(info.name());
        if (auto format = refused_format(key)) throw BadAdapter(quote(key) + " is " + *format + ", which vramd does not apply");
        const Suffix* suffix = nullptr;
        for (const auto& s : kSuffixes)
          if (key.ends_with(s.text)) {
            suffix = &s;
            break;
          }
        if (!suffix) throw BadAdapter(quote(key) + " is no LoRA key (lora_A/lora_B, lora_down/lora_up or alpha)");
        std::string module = key.substr(0, key.size() - std::strlen(suffix->text));
        if (module.starts_with("base_model.model.")) module = module.substr(17);
        kohya = kohya || module.starts_with("lora_");
        Pair& pair = pairs[module];
        switch (suffix->part) {
          case Suffix::Down: pair.down_key = key; break;
          case Suffix::Up: pair.up_key = key; break;
          case Suffix::Alpha: pair.alpha_key = key; break;
          case Suffix::EmbeddingDown: pair.down_key = key, pair.embedding = true; break;
          case Suffix::EmbeddingUp: pair.up_key = key, pair.embedding = true; break;
        }
      }
      if (pairs.empty()) throw BadAdapter("holds no tensors");
      if (kohya && underscored.empty()) underscored = by_underscored(model);
      // The adapter's names with or without the model's base prefix, as an update's (names.hpp).
      convert::ConversionPlan targets;
      for (const auto& [module, pair] : pairs) targets.tensors.push_back({module + ".weight", nullptr});
      const NameMatcher names(model, targets);

      // Each module to the model's weight.
      const auto find = [&](const std::string& module) -> Parameter* {
        if (kohya) {
          const auto it = underscored.find(kohya_parts(module).second);
          return it == underscored.end() ? nullptr : it->second;
        }
        if (Parameter* found = model.find(names.canonical(module + ".weight"))) return found;
        if (const size_t dot = module.find('.'); dot != std::string::npos)
          return model.find(names.canonical(module.substr(dot + 1) + ".weight"));
        return nullptr;
      };
      std::map<std::string, std::vector<std::string>> unmatched;  // by component
      std::set<std::string> matched_components;
      // What each module changes: a weight of the model, or else a checkpoint tensor the
      // converter reads (the key it is read by).
      struct Target {
        std::string module;
        Parameter* parameter = nullptr;
        std::string source;
        const SourceReaders* readers = nullptr;
      };
      const auto source_of = [&](const std::string& module) -> std::pair<std::string, const SourceReaders*> {
        if (kohya) return {};
        for (const std::string& key : {module + ".weight", module.substr(module.find('.') + 1) + ".weight"})
          if (const SourceReaders* readers = readers_of(key)) return {key, readers};
        return {};
      };
      std::vector<Target> found;
      for (const auto& [module, pair] : pairs) {
        Parameter* parameter = find(module);
        auto [source, readers] = parameter ? std::pair<std::string, const SourceReaders*>() : source_of(module);
        if (parameter || readers) {
          found.push_back({module, parameter, source, readers});
          matched_components.insert(component_of(module, kohya));
        } else {
          unmatched[component_of(module, kohya)].push_back(module);
        }
      }
      if (found.empty())
        throw BadAdapter("none of its " + counted(pairs.size(), "module") + " is the model's (" +
                         quote(pairs.begin()->first) + ", ...): is it an adapter of another model?");
      size_t skipped = 0;
      for (const auto& [component, modules] : unmatched) {
        // A file for several models (not a PEFT folder, which is one model's): a component of
        // which no module is this model's is another model's part of it.
        if (!peft && !matched_components.count(component) && component != modules[0]) {
          skipped += modules.size();
          continue;
        }
        std::vector<std::string_view> candidates(all_names.begin(), all_names.end());
        const auto near = did_you_mean(modules[0] + ".weight", candidates);
        throw BadAdapter("module " + quote(modules[0]) + " is not the model's" +
                         (near ? " (did you mean " + quote(*near) + "?)" : "") +
                         (modules.size() > 1 ? ", nor " + counted(modules.size() - 1, "other") : ""));
      }
      if (skipped)
        set.warnings.push_back(where + ": " + counted(skipped, "module") + " of components this model lacks skipped");

      model::AdapterReport adapter{lora.path, lora.scale, peft ? "peft" : kohya ? "kohya" : "diffusers", 0, 0};
      for (const auto& [module, parameter, source, readers] : found) {
        const Pair& pair = pairs[module];
        const std::string& key = pair.down_key.empty() ? pair.up_key : pair.down_key;
        if (pair.down_key.empty() || pair.up_key.empty())
          throw BadAdapter(quote(key) + " has no " + (pair.down_key.empty() ? "down (lora_A)" : "up (lora_B)") + " factor beside it");
        const std::vector<Parameter*> changed = parameter ? std::vector{parameter} : readers->parameters;
        for (const Parameter* weight : changed) {
          if (weight->tied)
            throw BadAdapter(quote(key) + " changes " + quote(weight->name) + ", which is tied to " + quote(weight->tied->name) +
                             ": an update of one would change both");
          if (!assigned.count(weight))
            throw BadAdapter(quote(key) + " changes " + quote(weight->name) + ", which the checkpoint does not fill");
        }
        if (!parameter) {
          const std::string makes = quote(source) + ", which the converter makes into " + quote(changed.front()->name) +
                                    (changed.size() > 1 ? " and " + counted(changed.size() - 1, "more") : "");
          if (readers->sharded)
            throw BadAdapter(quote(key) + " changes the checkpoint's " + makes +
                             ", split across files: vramd adapts such a tensor only whole");
          if (applied != Applied::Fused)
            throw BadAdapter(quote(key) + " changes the checkpoint's " + makes + ": only fused (fuse_lora = true) adds it "
                             "there, before the conversion");
        }
        if (peft && !targeted(peft->target_modules, module))
          throw BadAdapter(quote(key) + ": module " + quote(module) + " is not among adapter_config.json's target_modules");
        const storage::ReadOptions as_float{.dtype = c10::kFloat, .mode = storage::ReadMode::Copy};
        // Adapters its clients apply are checked here, never kept: their shapes will do (the
        // header's ranges were checked against the file's size when it was opened).
        const auto factor = [&](const std::string& name) {
          return applied == Applied::ByClients
                     ? at::empty(map.find(name)->shape, at::TensorOptions().device(c10::kMeta).dtype(c10::kFloat))
                     : storage::load_tensor(map, name, as_float);
        };
        at::Tensor down = factor(pair.down_key), up = factor(pair.up_key);
        const auto& shape = parameter ? parameter->shape : readers->shape;
        const model::Layer* layer = parameter && layer_of.count(parameter) ? layer_of.at(parameter) : nullptr;
        // GPT-2's Conv1D holds its weight as [in, out]: the update is transposed (peft's fan_in_fan_out).
        const bool conv1d = layer && layer->kind() == model::LayerKind::Conv1D;
        const std::string names_it = quote(key) + " (for " + quote(parameter ? parameter->name : source) + ", " + format_shape(shape) + ")";
        if (pair.embedding) {
          if (shape.size() != 2 || down.dim() != 2 || up.dim() != 2 || down.size(1) != shape[0] || up.size(0) != shape[1])
            throw BadAdapter(names_it + ": an embedding's factors are [r, " + std::to_string(shape.empty() ? 0 : shape[0]) +
                             "] and [" + std::to_string(shape.size() > 1 ? shape[1] : 0) + ", r], not " + shape_of(down) + " and " + shape_of(up));
        } else if (shape.size() == 4) {
          if (down.dim() != 4)
            throw BadAdapter(names_it + ": a " + std::to_string(down.dim()) + "-D adapter on a convolution, whose down factor is [r, " +
                             std::to_string(shape[1]) + ", " + std::to_string(shape[2]) + ", " + std::to_string(shape[3]) + "]");
          if (down.size(1) != shape[1] || down.size(2) != shape[2] || down.size(3) != shape[3] || up.dim() != 4 ||
              up.size(0) != shape[0] || up.size(2) != 1 || up.size(3) != 1)
            throw BadAdapter(names_it + ": factors " + shape_of(down) + " and " + shape_of(up) + " do not fit it");
        } else if (shape.size() == 2) {
          if (down.dim() != 2 || up.dim() != 2)
            throw BadAdapter(names_it + ": factors " + shape_of(down) + " and " + shape_of(up) + " are not a linear layer's");
          if (down.size(1) != shape[conv1d ? 0 : 1] || up.size(0) != shape[conv1d ? 1 : 0])
            throw BadAdapter(names_it + ": factors " + shape_of(down) + " and " + shape_of(up) + " do not fit it");
        } else {
          throw BadAdapter(names_it + ": only linear, convolution and embedding weights take a LoRA");
        }
        const int64_t rank = down.size(0);
        if (up.size(1) != rank)
          throw BadAdapter(names_it + ": rank mismatch: its down factor has " + std::to_string(rank) + " rows, its up factor " +
                           std::to_string(up.size(1)) + " columns");
        double alpha = static_cast<double>(rank);
        if (peft) {
          const json* r = pattern_for(peft->rank_pattern, module);
          const int64_t expected = r ? r->get<int64_t>() : peft->r;
          if (expected != rank)
            throw BadAdapter(names_it + ": rank mismatch: adapter_config.json says r = " + std::to_string(expected) +
                             (r ? " (rank_pattern)" : "") + ", its factors have rank " + std::to_string(rank));
          const json* a = pattern_for(peft->alpha_pattern, module);
          alpha = a ? a->get<double>() : peft->alpha;
        } else if (!pair.alpha_key.empty()) {
          const at::Tensor value = storage::load_tensor(map, pair.alpha_key, as_float);
          if (value.numel() != 1) throw BadAdapter(quote(pair.alpha_key) + " is " + shape_of(value) + ", not one number");
          alpha = value.item<double>();
        }
        const double per_rank = peft && peft->rslora ? std::sqrt(static_cast<double>(rank)) : static_cast<double>(rank);
        if (applied == Applied::Unfused && (!layer || (layer->kind() != model::LayerKind::Linear && !conv1d &&
                                   layer->kind() != model::LayerKind::Embedding) || weight_of(*layer) != parameter))
          throw BadAdapter(names_it + ": computed unfused (fuse_lora = false) only on the weight of a linear or embedding "
                           "layer the model computes; fuse_lora = true adds it to the weight instead");
        const model::LoraTerms::Term term{down, up, lora.scale * alpha / per_rank, pair.embedding || conv1d};
        if (parameter) {
          patches[parameter].terms.push_back(term);
        } else {
          for (const Parameter* reader : changed) {
            auto& sources = patches[reader].sources;
            auto it = std::find_if(sources.begin(), sources.end(), [&](const auto& s) { return s.key == source; });
            if (it == sources.end()) it = sources.insert(sources.end(), {source, {}});
            it->terms.push_back(term);
          }
        }
        adapter.modules += 1;
        adapter.bytes += down.nbytes() + up.nbytes();
      }
      set.adapters.push_back(std::move(adapter));
    } catch (const BadAdapter& e) {
      throw BadAdapter(where + ": " + e.what());
    }
  }
  for (auto& [parameter, patch] : patches) set.patches[parameter] = std::make_shared<const weights::Patch>(std::move(patch));
  return set;
}

void attach_loras(const config::ModelConfig& config, model::Model& model, std::vector<weights::Assignment>& assignments,
                  model::LoadReport& report) {
  if (config.lora.empty()) return;
  const std::string where = config::where(config, "lora");
  const Applied how = applied(config);
  LoraSet set = read_loras(config.lora, model, assignments, how,
                           [&](size_t index) { return where + ": [[lora]] " + std::to_string(index + 1); });
  if (how == Applied::Fused) {
    for (auto& assignment : assignments)
      if (auto it = set.patches.find(assignment.parameter); it != set.patches.end()) assignment.patch = it->second;
  } else if (how == Applied::Unfused) {
    for (const auto& layer : model.layers())
      if (auto it = set.patches.find(weight_of(*layer)); it != set.patches.end())
        layer->set_lora(it->second);  // on the CPU until place_loras
  }
  report.adapters = std::move(set.adapters);
  report.warnings.insert(report.warnings.end(), set.warnings.begin(), set.warnings.end());
}

namespace {

// Terms a layer computes unfused, on `device` in `dtype`.
std::shared_ptr<const model::LoraTerms> placed(const model::LoraTerms& terms, c10::Device device, c10::ScalarType dtype) {
  auto out = std::make_shared<model::LoraTerms>(terms);
  for (auto& term : out->terms) {
    term.down = term.down.to(device, dtype);
    term.up = term.up.to(device, dtype);
  }
  return out;
}

}  // namespace

void place_loras(model::Model& model) {
  for (const auto& layer : model.layers())
    if (layer->lora()) layer->set_lora(placed(*layer->lora(), model.device(), model.dtype()));
}

std::vector<model::AdapterReport> switch_loras(weights::LoadedModel& loaded, const config::ModelConfig& config,
                                               const std::vector<config::LoraConfig>& loras, const UpdateSpace& space,
                                               UpdateReport& report) {
  auto& assignments = loaded.source->assignments;
  const Applied how = applied(config);
  LoraSet set;
  try {
    set = read_loras(loras, *loaded.model, assignments, how,
                     [](size_t index) { return "loras[" + std::to_string(index) + "]"; });
  } catch (const BadAdapter& e) {
    throw BadUpdate(std::string(e.what()) + "; the adapters in force are kept");
  }
  if (how == Applied::ByClients) {  // the clients take the new set with the next version
    report.tensors = set.patches.size();
    loaded.report.adapters = set.adapters;
    return std::move(set.adapters);
  }
  if (how == Applied::Unfused) {  // each layer's terms replaced, no weight written
    std::vector<std::pair<model::Layer*, std::shared_ptr<const model::LoraTerms>>> changes;
    for (const auto& layer : loaded.model->layers()) {
      const auto it = set.patches.find(weight_of(*layer));
      auto next = it == set.patches.end() ? nullptr : placed(*it->second, loaded.model->device(), loaded.model->dtype());
      if (layer->lora() || next) changes.emplace_back(layer.get(), std::move(next));
    }
    for (auto& [layer, next] : changes) layer->set_lora(std::move(next));
    report.tensors = changes.size();
    loaded.report.adapters = set.adapters;
    return std::move(set.adapters);
  }
  // Every weight the old set or the new one changes takes its value anew: the checkpoint's, plus
  // the new set's terms where it has any (exactly the checkpoint's where it has none).
  weights::WeightUpdate update;
  update.in_place = true;  // values of this update's own, which nothing else changes
  place(update, space);
  std::vector<std::pair<weights::Assignment*, std::shared_ptr<const weights::Patch>>> changes;
  for (auto& assignment : assignments) {
    const auto it = set.patches.find(assignment.parameter);
    std::shared_ptr<const weights::Patch> next = it == set.patches.end() ? nullptr : it->second;
    if (!assignment.patch && !next) continue;
    if (assignment.block)
      throw weights::NotUpdatable("model " + quote(config.name) + " holds " + quote(assignment.parameter->name) +
                                  " as packed GGUF blocks, which an adapter cannot change in place: give the model its "
                                  "adapters in its config ([[lora]]), where such weights are unpacked at load");
    changes.emplace_back(&assignment, next);
    // Read from the checkpoint at each use (streamed from disk): its next read applies the new set.
    if (loaded.weights->rereads(*assignment.parameter)) {
      update.reread.push_back(assignment.parameter);
      continue;
    }
    weights::Assignment with = assignment;
    with.patch = next;
    // As stored (its expression's dtype) where no adapter changes it: cast into its state as a load does.
    const storage::DType stored = assignment.expr->dtype;
    const bool as_stored = !next && storage::dtype_block(stored) == 1 && storage::is_floating(stored);
    const c10::ScalarType dtype = as_stored ? storage::scalar_type(stored) : c10::kFloat;
    update.values.emplace_back(assignment.parameter, loaded.source->read(with, c10::kCPU, dtype, true));
    report.bytes += static_cast<uint64_t>(assignment.parameter->elements()) * c10::elementSize(dtype);
  }
  report.tensors = changes.size();
  if (!update.values.empty() || !update.reread.empty()) loaded.weights->update(config.name, update);
  for (auto& [assignment, next] : changes) assignment->patch = std::move(next);
  loaded.report.adapters = set.adapters;
  return std::move(set.adapters);
}

}  // namespace vramd::load
