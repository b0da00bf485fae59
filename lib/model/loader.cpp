#include "model/loader.hpp"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "convert/converter.hpp"
#include "convert/evaluate.hpp"
#include "hparams/hyperparams.hpp"
#include "model/registry.hpp"
#include "storage/file.hpp"
#include "storage/safetensors_header.hpp"
#include "storage/tensor_io.hpp"
#include "util/clock.hpp"
#include "util/format.hpp"
#include "weights/source.hpp"
#include "weights/weights.hpp"

namespace vramd::model {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// "auto": the floating dtype that holds most of the checkpoint's bytes (bfloat16 for float8).
c10::ScalarType dominant_dtype(const convert::ConversionPlan& plan) {
  std::map<storage::DType, uint64_t> bytes;
  for (const auto& [target, expr] : plan.tensors)
    if (storage::is_floating(expr->dtype)) bytes[expr->dtype] += storage::element_count(expr->shape) * storage::dtype_bits(expr->dtype);
  if (bytes.empty()) return c10::kFloat;
  auto most = std::max_element(bytes.begin(), bytes.end(), [](auto& a, auto& b) { return a.second < b.second; });
  const c10::ScalarType type = storage::scalar_type(most->first);
  return type == c10::kFloat || type == c10::kBFloat16 || type == c10::kHalf ? type : c10::kBFloat16;
}

constexpr size_t kListed = 12;  // names a message lists, before "and N more"

// The first `limit` of `items`, as they are, and how many more.
std::string joined_listed(const std::vector<std::string>& items, size_t limit = kListed) {
  std::string text;
  for (size_t i = 0; i < items.size() && i < limit; ++i) text += (i ? ", " : "") + items[i];
  if (items.size() > limit) text += ", and " + std::to_string(items.size() - limit) + " more";
  return text;
}

std::string listed(const std::vector<std::string>& names, size_t limit = kListed) {
  std::vector<std::string> quoted;
  for (const auto& name : names) quoted.push_back(quote(name));
  return joined_listed(quoted, limit);
}

std::string joined(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += (text.empty() ? "" : ", ") + line;
  return text;
}

// A checkpoint of the bare base model lacks the head model's prefix ("model."), and a
// checkpoint with a head has one the bare model lacks: names are matched either way.
class NameMatcher {
 public:
  NameMatcher(Model& model, const convert::ConversionPlan& plan) : prefix_(model.base_prefix()) {
    if (prefix_.empty()) return;
    bool model_has = false, checkpoint_has = false;
    for (const Parameter* parameter : model.parameters()) model_has |= parameter->name.starts_with(prefix_);
    for (const auto& tensor : plan.tensors) checkpoint_has |= tensor.target.starts_with(prefix_);
    add_ = model_has && !checkpoint_has;
    strip_ = !model_has && checkpoint_has;
  }
  std::string canonical(const std::string& target) const {
    if (add_) return prefix_ + target;
    if (strip_ && target.starts_with(prefix_)) return target.substr(prefix_.size());
    return target;
  }

 private:
  std::string prefix_;
  bool add_ = false, strip_ = false;
};

// Everything up to reading data: the index, the converter's plan, the model on the meta
// device, and which expression fills which parameter.
struct Prepared {
  storage::DiskMap map;
  std::string architecture;
  std::unique_ptr<Model> model;
  std::vector<weights::Assignment> assignments;
  LoadReport report;
};

Prepared prepare(const config::ModelConfig& config) {
  const auto plan_start = Clock::now();
  const std::string& where = config.path;
  auto map = config::open_checkpoint(config);
  LoadReport report;
  report.checkpoint = map.description();
  report.warnings.assign(map.warnings().begin(), map.warnings().end());
  if (map.tensors().empty()) fail(where, "checkpoint " + map.description() + " holds no tensors" +
                                             (config.prefix.empty() ? "" : " under prefix " + quote(config.prefix)));

  const std::string folder = fs::path(map.files()[0].path).parent_path().string();
  const hparams::Hyperparams hyperparams = hparams::Hyperparams::for_model(config, map);
  const family::Catalog families(config.architecture_folders);
  if (config.architecture.empty() && hyperparams.string("model_type", "").empty())
    throw NoArchitecture(where + ": no architecture: set architecture = \"...\" (" + families.names() +
                         ", weights) or put a config.json with model_type in " + folder);

  const auto plan = [&] {
    if (config.converter.empty()) return convert::identity_plan(map);
    try {
      return convert::run_converter(config.converter, map, hyperparams.json());
    } catch (const Error& e) {
      fail(where, std::string("converter: ") + e.what());
    }
  }();
  report.printed = plan.printed;
  const auto& computation = config.vram.computation.dtype;
  const c10::ScalarType dtype = computation ? storage::scalar_type(*computation) : dominant_dtype(plan);
  std::unique_ptr<Model> model;
  try {
    TensorShapes shapes;
    for (const auto& [target, expr] : plan.tensors) shapes.emplace_back(target, expr->shape);
    model = build_model(config.architecture, hyperparams, dtype, shapes, families);
  } catch (const Error& e) {
    fail(where, e.what());
  }
  const std::string& architecture = model->architecture();

  // Every checkpoint tensor to its parameter.
  const NameMatcher names(*model, plan);
  std::vector<weights::Assignment> assignments;
  std::vector<std::string> mismatched, unexpected;
  std::set<const Parameter*> assigned;
  for (const auto& [target, expr] : plan.tensors) {
    const std::string name = names.canonical(target);
    Parameter* parameter = model->find(name);
    if (!parameter) {
      if (!model->ignores(name)) unexpected.push_back(target);
      continue;
    }
    if (parameter->tied) continue;  // loaded through the parameter it is tied to
    assigned.insert(parameter);
    if (expr->shape != parameter->shape) {
      mismatched.push_back(quote(target) + " is " + format_shape(expr->shape) + ", the architecture expects " +
                           format_shape(parameter->shape));
      continue;
    }
    // Architecture "weights" computes nothing: its integer tensors are held as they are.
    const bool as_is = architecture == "weights" && config.partition.world_size == 1 && weights::held_as_is(expr->dtype);
    if (!storage::is_floating(expr->dtype) && !as_is) {
      mismatched.push_back(quote(target) + " is " + std::string(storage::dtype_name(expr->dtype)) +
                           (architecture != "weights" ? ", the architecture expects floating-point weights"
                            : config.partition.world_size > 1 ? ", and a partitioned model holds floating-point weights only"
                                                              : ", which architecture weights holds only as GGUF blocks"));
      continue;
    }
    uint64_t order = UINT64_MAX;
    expr->for_each_source([&](const convert::Expr& source) {
      const auto& info = map.at(source.source, source.shard);
      order = std::min(order, (uint64_t{info.file} << 48) + info.offset);
    });
    assignments.push_back({parameter, expr, order});
  }
  std::vector<std::string> missing;
  for (const Parameter* parameter : model->parameters())
    if (!parameter->tied && !assigned.count(parameter)) missing.push_back(parameter->name);

  std::string problems;
  const auto add = [&](const std::string& text) { problems += (problems.empty() ? "" : "; ") + text; };
  if (!mismatched.empty()) add("mismatched: " + joined(mismatched));
  if (config.strict && !missing.empty())
    add(std::to_string(missing.size()) + " missing: " + listed(missing));
  if (config.strict && !unexpected.empty())
    add(std::to_string(unexpected.size()) + " unexpected: " + listed(unexpected));
  if (!problems.empty()) {
    // Loading anyway helps only where some names matched; where none did, the names are wrong.
    const std::string advice =
        !mismatched.empty() ? ""
        : !assigned.empty() ? " (strict = false loads anyway)"
        : " (no tensor matches a parameter: check the prefix" + std::string(config.converter.empty() ? ", or give a converter" : " and the converter") +
              "; vramctl convert shows the names it makes)";
    fail(where, "checkpoint " + map.description() + " does not fit architecture " + architecture + " (" +
                    counted(plan.tensors.size(), "tensor") + (config.converter.empty() ? "" : " from " + config.converter) +
                    "): " + problems + advice);
  }
  report.missing = std::move(missing);
  report.unexpected = std::move(unexpected);
  report.plan_seconds = seconds_since(plan_start);
  std::sort(assignments.begin(), assignments.end(), [](auto& a, auto& b) { return a.order < b.order; });
  for (const auto& a : assignments) {
    const uint64_t bytes = weights::held_bytes(a, weights::held_dtype(a, dtype, /*packed=*/false));  // an integer: its own
    report.bytes += bytes;
    report.largest = std::max(report.largest, bytes);
  }
  report.tensors = assignments.size();
  return {std::move(map), architecture, std::move(model), std::move(assignments), std::move(report)};
}

}  // namespace

DryModel dry_run_model(const config::ModelConfig& config) {
  Prepared prepared = prepare(config);
  const auto source = weights::make_source(std::move(prepared.map), std::move(prepared.assignments), config);
  DryRun dry{prepared.architecture, convert::dtype_torch_name(storage::dtype_of(prepared.model->dtype())),
             std::move(prepared.report), weights::plan_weights(*prepared.model, *source, config)};
  return {std::move(dry), std::move(prepared.model)};
}

DryRun dry_run(const config::ModelConfig& config) { return dry_run_model(config).dry; }

LoadedModel load_model(const config::ModelConfig& config, const LoadOptions& options) {
  settle_vector_math();
  auto [map, architecture, model, assignments, report] = prepare(config);
  auto source = weights::make_source(std::move(map), std::move(assignments), config);
  const auto load_start = Clock::now();
  auto weights = weights::make_weights(*model, source, config, options, report);
  model->set_device(weights::torch_device(config.vram.computation.device));
  report.load_seconds = seconds_since(load_start);
  return {std::move(model), std::move(report), std::move(source), std::move(weights)};
}

Transition offload(LoadedModel& loaded) {
  const auto start = Clock::now();
  const uint64_t bytes = loaded.weights->sleep();
  return {bytes, seconds_since(start)};
}

Transition onload(LoadedModel& loaded) {
  const auto start = Clock::now();
  const uint64_t bytes = loaded.weights->wake();
  return {bytes, seconds_since(start)};
}

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
  update.room = space.room;
  update.shared_in_place = space.shared_in_place;
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
      const hparams::Hyperparams hyperparams = hparams::Hyperparams::for_model(config, loaded.source->map);
      return convert::run_converter(config.converter, map, hyperparams.json());
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
  update.room = space.room;
  update.shared_in_place = space.shared_in_place;
  update.check = [&map, &where] {
    try {
      map.check_mappings();
    } catch (const storage::MappingLost& e) {
      throw BadUpdate(where + ": " + e.what() + "; nothing was updated");
    }
  };
  return apply_update(loaded, config, where, incoming, NameMatcher(*loaded.model, plan), std::move(update));
}

}  // namespace vramd::model
