#include "load/update.hpp"

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <set>

#include "convert/converter.hpp"
#include "convert/evaluate.hpp"
#include "hparams/hyperparams.hpp"
#include "load/conversion.hpp"
#include "load/names.hpp"
#include "storage/file.hpp"
#include "storage/safetensors_header.hpp"
#include "storage/tensor_io.hpp"
#include "util/format.hpp"
#include "weights/source.hpp"
#include "weights/weights.hpp"

namespace vramd::load {

void place(weights::WeightUpdate& update, const UpdateSpace& space) {
  update.room = space.room;
  update.shared_in_place = space.shared_in_place;
  update.shared = space.shared;
}

using model::Model;
using model::Parameter;
using weights::LoadedModel;

namespace {

// One tensor of an update: its name as given, what it is, and how to read it (onto the CPU).
struct Incoming {
  std::string name;
  std::vector<int64_t> shape;
  storage::DType dtype;
  std::function<at::Tensor()> read;
};

UpdateReport apply_update(LoadedModel& loaded, const config::ModelConfig& config, const std::string& where,
                          const std::vector<Incoming>& incoming, const NameMatcher& names, weights::WeightUpdate update) {
  if (incoming.empty()) throw BadUpdate(where + ": holds no tensors");
  Model& model = *loaded.model;
  std::map<Parameter*, const Incoming*> chosen;
  std::set<Parameter*> direct;  // given under their own name, which a tied name does not override
  std::vector<std::string> unknown, mismatched;
  for (const auto& tensor : incoming) {
    // A parameter's own name, or a checkpoint's with or without the head's prefix (as at load;
    // the matcher's guess from a few tensors alone can miss a name given as the model's).
    std::string name = tensor.name;
    Parameter* parameter = model.find(name);
    if (!parameter) parameter = model.find(name = names.canonical(tensor.name));
    if (!parameter) {
      if (!model.ignores(name)) unknown.push_back(tensor.name);
      continue;
    }
    if (tensor.shape != parameter->shape) {
      mismatched.push_back(quote(tensor.name) + " is " + format_shape(tensor.shape) + ", the parameter is " +
                           format_shape(parameter->shape));
      continue;
    }
    if (!storage::is_floating(tensor.dtype)) {
      mismatched.push_back(quote(tensor.name) + " is " + std::string(storage::dtype_name(tensor.dtype)) +
                           ", the weights are floating-point");
      continue;
    }
    const bool tied = parameter->tied != nullptr;
    if (tied) parameter = const_cast<Parameter*>(parameter->tied);  // one storage: updated through its owner
    if (tied && direct.count(parameter)) continue;
    if (!tied) direct.insert(parameter);
    chosen[parameter] = &tensor;
  }
  std::string problems;
  const auto add = [&](const std::string& text) { problems += (problems.empty() ? "" : "; ") + text; };
  if (!unknown.empty()) {
    // The nearest parameter's name beside each, as a forward's misspelled input gets.
    std::vector<std::string> names;
    for (const auto* parameter : model.parameters()) names.push_back(parameter->name);
    const std::vector<std::string_view> views(names.begin(), names.end());
    std::vector<std::string> said;
    for (size_t i = 0; i < unknown.size(); ++i) {  // the ones the message lists
      const auto near = i < kListed ? did_you_mean(unknown[i], views) : std::nullopt;
      said.push_back(quote(unknown[i]) + (near ? " (did you mean " + quote(*near) + "?)" : ""));
    }
    add(std::to_string(unknown.size()) + " not the model's: " + joined_listed(said));
  }
  if (!mismatched.empty()) add("mismatched: " + joined(mismatched));
  if (!problems.empty())
    throw BadUpdate(where + " does not fit model " + quote(config.name) + " (" + model.architecture() + "): " + problems +
                    "; nothing was updated");
  if (chosen.empty()) throw BadUpdate(where + ": none of its tensors is a weight of model " + quote(config.name));

  // A weight its LoRA adapters change holds W + its update, which a new W alone would drop.
  std::vector<std::string> adapted;
  for (const auto& a : loaded.source->assignments)
    if (a.patch && chosen.count(a.parameter)) adapted.push_back(chosen.at(a.parameter)->name);
  if (!adapted.empty())
    throw BadUpdate(where + ": " + counted(adapted.size(), "tensor") + " of model " + quote(config.name) +
                    " that its [[lora]] adapters change, which an update does not take yet: " + listed(adapted) +
                    "; nothing was updated");

  UpdateReport report;
  for (const auto& [parameter, tensor] : chosen) {
    try {
      update.values.emplace_back(parameter, tensor->read());
    } catch (const Error& e) {
      throw BadUpdate(where + ": reading " + quote(tensor->name) + ": " + e.what() + "; nothing was updated");
    }
    report.bytes += static_cast<uint64_t>(parameter->elements()) * parameter->value.element_size();
  }
  report.tensors = update.values.size();
  loaded.weights->update(config.name, update);
  return report;
}

}  // namespace

UpdateReport update_from_bytes(LoadedModel& loaded, const config::ModelConfig& config, std::span<const std::byte> bytes,
                               const std::string& where, const UpdateSpace& space,
                               std::function<void()> before_write, std::shared_ptr<void> shared) {
  storage::SafetensorsHeader header;
  try {
    header = storage::parse_safetensors_file(bytes);
  } catch (const Error& e) {
    throw BadUpdate(where + " is not a safetensors file: " + e.what());
  }
  std::vector<Incoming> incoming;
  convert::ConversionPlan names_only;
  for (const auto& record : header.tensors) {
    incoming.push_back({record.name, record.shape, record.dtype, [&bytes, &header, &record, &shared] {
      // The bytes outlive the update; the weights copy them into memory of their own, or keep
      // views that hold `shared`.
      return storage::view_or_copy(bytes.subspan(header.data_offset + record.begin, record.end - record.begin),
                                   storage::scalar_type(record.dtype), record.shape, shared);
    }});
    names_only.tensors.push_back({record.name, nullptr});
  }
  weights::WeightUpdate update;
  update.in_place = true;  // bytes that cannot change while they are read
  update.adopt = shared != nullptr;
  place(update, space);
  update.check = std::move(before_write);
  return apply_update(loaded, config, where, incoming, NameMatcher(*loaded.model, names_only), std::move(update));
}

namespace {

// An update's checkpoint, indexed and converted as the config's own is.
struct UpdateCheckpoint {
  std::string where;
  storage::DiskMap map;
  convert::ConversionPlan plan;
};

UpdateCheckpoint open_update(const LoadedModel& loaded, const config::ModelConfig& config, const std::string& path) {
  const std::string where = "the update " + quote(path);
  storage::DiskMap map = [&] {
    try {
      return storage::DiskMap::open(path, {.prefix = config.prefix, .strip_prefix = !config.keep_prefix,
                                           .shards = !config.converter.empty()});
    } catch (const Error& e) {
      throw BadUpdate(where + ": " + e.what());
    }
  }();
  auto plan = [&] {
    if (config.converter.empty()) return convert::identity_plan(map);
    try {
      return conversion_plan(config, map, hparams::Hyperparams::for_model(config, loaded.source->map));
    } catch (const Error& e) {
      throw BadUpdate(where + ": converter " + config.converter + ": " + e.what());
    }
  }();
  return {where, std::move(map), std::move(plan)};
}

}  // namespace

std::string checkpoint_as_safetensors(const LoadedModel& loaded, const config::ModelConfig& config, const std::string& path) {
  const auto [where, map, plan] = open_update(loaded, config, path);
  storage::NamedTensors tensors;
  try {
    for (const auto& [target, expr] : plan.tensors) tensors.emplace_back(target, convert::evaluate(*expr, map).contiguous());
    std::string bytes = storage::serialize_tensors(tensors);
    map.check_mappings();
    return bytes;
  } catch (const Error& e) {
    throw BadUpdate(where + ": " + e.what() + "; nothing was updated");
  }
}

UpdateReport update_from_checkpoint(LoadedModel& loaded, const config::ModelConfig& config, const std::string& path,
                                    const UpdateSpace& space) {
  const auto [where, map, plan] = open_update(loaded, config, path);
  std::vector<Incoming> incoming;
  for (const auto& [target, expr] : plan.tensors)
    incoming.push_back({target, expr->shape, expr->dtype, [&map, expr = expr] {
      return convert::evaluate(*expr, map).contiguous();
    }});
  // The file may be cut short while it is read: the new values go beside the old, and are taken
  // only once every read is whole.
  weights::WeightUpdate update;
  place(update, space);
  update.check = [&map, &where] {
    try {
      map.check_mappings();
    } catch (const storage::MappingLost& e) {
      throw BadUpdate(where + ": " + e.what() + "; nothing was updated");
    }
  };
  return apply_update(loaded, config, where, incoming, NameMatcher(*loaded.model, plan), std::move(update));
}

}  // namespace vramd::load
