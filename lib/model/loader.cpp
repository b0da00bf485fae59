#include "model/loader.hpp"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <set>

#include "convert/converter.hpp"
#include "convert/evaluate.hpp"
#include "dist/communicator.hpp"
#include "model/gguf_config.hpp"
#include "model/partition.hpp"
#include "model/registry.hpp"
#include "model/vram.hpp"
#include "model/weight_source.hpp"
#include "storage/page_cache.hpp"
#include "storage/tensor_io.hpp"
#include "util/format.hpp"

namespace vramd::model {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

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

std::string listed(const std::vector<std::string>& names, size_t limit = 12) {
  std::string text;
  for (size_t i = 0; i < names.size() && i < limit; ++i) text += (i ? ", " : "") + quote(names[i]);
  if (names.size() > limit) text += ", and " + std::to_string(names.size() - limit) + " more";
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
  std::vector<Assignment> assignments;
  LoadReport report;
};

Prepared prepare(const config::ModelConfig& config) {
  const auto plan_start = Clock::now();
  const std::string& where = config.path;
  auto map = storage::DiskMap::open(config.checkpoint, {config.prefix, !config.keep_prefix});
  LoadReport report;
  report.checkpoint = map.description();
  report.warnings.assign(map.warnings().begin(), map.warnings().end());
  if (map.tensors().empty()) fail(where, "checkpoint " + map.description() + " holds no tensors" +
                                             (config.prefix.empty() ? "" : " under prefix " + quote(config.prefix)));

  const std::string folder = fs::path(map.files()[0].path).parent_path().string();
  const bool gguf = map.files()[0].format == storage::FileFormat::Gguf;
  const Hyperparams hyperparams =
      Hyperparams::for_checkpoint(folder, config.arch_json, config.path, gguf ? gguf_config_json(map) : "",
                                  "the GGUF metadata of " + map.files()[0].path);
  std::string architecture = config.architecture.empty() ? hyperparams.string("model_type", "") : config.architecture;
  if (architecture.empty())
    throw NoArchitecture(where + ": no architecture: set architecture = \"...\" (" + known_architectures() +
                         ") or put a config.json with model_type in " + folder);

  const auto plan = [&] {
    if (config.converter.empty()) return convert::identity_plan(map);
    try {
      return convert::run_converter(config.converter, map, hyperparams.json());
    } catch (const Error& e) {
      fail(where, std::string("converter: ") + e.what());
    }
  }();
  report.printed = plan.printed;
  const std::string& dtype_name = config.vram.computation.dtype;
  const c10::ScalarType dtype = dtype_name == "auto" ? dominant_dtype(plan) : state_dtype(dtype_name, c10::kFloat);
  std::unique_ptr<Model> model;
  try {
    TensorShapes shapes;
    if (architecture == "weights")
      for (const auto& [target, expr] : plan.tensors) shapes.emplace_back(target, expr->shape);
    model = build_model(architecture, hyperparams, dtype, shapes);
  } catch (const Error& e) {
    fail(where, e.what());
  }

  // Every checkpoint tensor to its parameter.
  const NameMatcher names(*model, plan);
  std::vector<Assignment> assignments;
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
    if (!storage::is_floating(expr->dtype)) {
      mismatched.push_back(quote(target) + " is " + std::string(storage::dtype_name(expr->dtype)) +
                           ", the architecture expects floating-point weights");
      continue;
    }
    uint64_t order = UINT64_MAX;
    expr->for_each_source([&](const std::string& key) {
      const auto& info = map.at(key);
      order = std::min(order, (uint64_t{info.file} << 48) + info.offset);
    });
    assignments.push_back({parameter, expr, order});
  }
  std::vector<std::string> missing;
  for (const Parameter* parameter : model->parameters())
    if (!parameter->tied && !assigned.count(parameter)) missing.push_back(parameter->name);

  std::string problems;
  const auto add = [&](const std::string& text) { problems += (problems.empty() ? "" : "; ") + text; };
  if (!mismatched.empty()) add("mismatched: " + [&] {
    std::string text;
    for (const auto& line : mismatched) text += (text.empty() ? "" : ", ") + line;
    return text;
  }());
  if (config.strict && !missing.empty())
    add(std::to_string(missing.size()) + " missing: " + listed(missing));
  if (config.strict && !unexpected.empty())
    add(std::to_string(unexpected.size()) + " unexpected: " + listed(unexpected));
  if (!problems.empty()) {
    fail(where, "checkpoint " + map.description() + " does not fit architecture " + architecture + " (" +
                    std::to_string(plan.tensors.size()) + " tensors" + (config.converter.empty() ? "" : " from " + config.converter) +
                    "): " + problems + (mismatched.empty() ? " (strict = false loads anyway)" : ""));
  }
  report.missing = std::move(missing);
  report.unexpected = std::move(unexpected);
  report.plan_seconds = seconds_since(plan_start);
  std::sort(assignments.begin(), assignments.end(), [](auto& a, auto& b) { return a.order < b.order; });
  for (const auto& a : assignments) {
    report.bytes += a.parameter->elements() * c10::elementSize(dtype);
    report.largest = std::max<uint64_t>(report.largest, a.parameter->elements() * c10::elementSize(dtype));
  }
  report.tensors = assignments.size();
  return {std::move(map), std::move(architecture), std::move(model), std::move(assignments), std::move(report)};
}

}  // namespace

DryModel dry_run_model(const config::ModelConfig& config) {
  Prepared prepared = prepare(config);
  DryRun dry{prepared.architecture, convert::dtype_torch_name(storage::dtype_of(prepared.model->dtype())), std::move(prepared.report)};
  return {std::move(dry), std::move(prepared.model)};
}

DryRun dry_run(const config::ModelConfig& config) { return dry_run_model(config).dry; }

c10::ScalarType state_dtype(const std::string& name, c10::ScalarType otherwise) {
  if (name.empty() || name == "auto") return otherwise;
  return storage::scalar_type(convert::parse_dtype_name(name));
}

at::Tensor WeightSource::read(const Assignment& a, c10::Device device, c10::ScalarType dtype, bool views) const {
  const auto mode = views ? storage::ReadMode::Auto : direct ? storage::ReadMode::Direct : storage::ReadMode::Copy;
  at::Tensor value = a.expr->op == convert::Expr::Op::Source
                         ? storage::load_tensor(map, map.at(a.expr->source), {.dtype = dtype, .mode = mode})
                         : convert::evaluate(*a.expr, map, mode).to(dtype);
  return device.is_cpu() ? value : value.to(device);
}

const storage::TensorInfo* WeightSource::stored(const Assignment& a, c10::ScalarType dtype) const {
  if (a.expr->op != convert::Expr::Op::Source) return nullptr;
  const auto& info = map.at(a.expr->source);
  if (storage::dtype_block(info.dtype) != 1) return nullptr;  // packed: unpacked on reading
  return storage::scalar_type(map, info) == dtype ? &info : nullptr;
}

void WeightSource::read_into(const Assignment& a, at::Tensor& out) const {
  const Assignment* const one = &a;
  read_into({&one, 1}, {&out, 1});
}

void WeightSource::read_into(std::span<const Assignment* const> parts, std::span<at::Tensor> outs) const {
  std::vector<storage::DiskMap::Range> reads;
  for (size_t i = 0; i < parts.size(); ++i) {
    at::Tensor& out = outs[i];
    const storage::TensorInfo* info = stored(*parts[i], out.scalar_type());
    if (info && out.is_contiguous() && out.nbytes() == info->nbytes)
      reads.push_back({info->file, info->offset, {static_cast<std::byte*>(out.mutable_data_ptr()), info->nbytes}});
    else
      out.copy_(read(*parts[i], c10::kCPU, out.scalar_type(), false));
  }
  map.read_ranges(reads, {.direct = direct});
}

namespace {

// Reads every assigned weight, one tensor at a time in checkpoint order, straight into `device`
// and `dtype`. Returns the bytes read.
uint64_t materialise(const WeightSource& source, c10::Device device, c10::ScalarType dtype, const LoadOptions& options,
                     size_t* zero_copy) {
  Progress progress;
  progress.tensors_total = source.assignments.size();
  for (const auto& a : source.assignments) progress.bytes_total += a.parameter->elements() * c10::elementSize(dtype);
  const bool views = options.zero_copy && device.is_cpu() && !source.direct;  // views are read through the page cache
  const auto& map = source.map;
  for (const auto& a : source.assignments) {
    const at::Tensor value = source.read(a, device, dtype, views);
    if (zero_copy && views && a.expr->op == convert::Expr::Op::Source &&
        value.const_data_ptr() == map.bytes(map.at(a.expr->source)).first.data())
      ++*zero_copy;
    a.parameter->value = value;
    progress.bytes_done += value.nbytes();
    progress.tensors_done++;
    progress.tensor = a.parameter->name;
    const bool last = progress.tensors_done == progress.tensors_total;  // nothing left to cancel
    if (options.progress && !options.progress(progress) && !last) {
      for (const auto& b : source.assignments) b.parameter->value = at::Tensor();
      throw Cancelled(source.where + ": load cancelled after " + std::to_string(progress.tensors_done) + " of " +
                      std::to_string(progress.tensors_total) + " tensors");
    }
  }
  return progress.bytes_done;
}

// Tells `options.progress` the load is done in one step (managed weights are read as they are
// needed, not tensor by tensor here).
void report_finished(const LoadOptions& options, size_t tensors, uint64_t bytes) {
  if (!options.progress) return;
  Progress done;
  done.tensors_done = done.tensors_total = tensors;
  done.bytes_done = done.bytes_total = bytes;
  options.progress(done);
}

// This rank's slices, once every rank of the group has joined; returns when all have read theirs.
std::shared_ptr<PartitionedWeights> load_partitioned(const config::ModelConfig& config, Model& model,
                                                     std::shared_ptr<WeightSource> source, const LoadOptions& options) {
  const int ranks = config.partition.world_size;
  if (!options.group)
    fail(config.path, "[partition].world_size = " + std::to_string(ranks) + " needs a group of " + std::to_string(ranks) +
                          " vramd processes, and this one runs alone (start them as torchrun does, with RANK, WORLD_SIZE, "
                          "MASTER_ADDR and MASTER_PORT, or try `vramctl run --ranks " + std::to_string(ranks) + "`)");
  if (options.group->size() != ranks)
    fail(config.path, "[partition].world_size = " + std::to_string(ranks) + ", but this group has " +
                          std::to_string(options.group->size()) + " ranks");
  const std::string name = options.partition_name.empty() ? "load/" + config.name : options.partition_name;
  auto communicator = std::make_shared<dist::Communicator>(options.group, name, config.partition.timeout);
  auto partition = std::make_shared<PartitionedWeights>(model, std::move(source), config, communicator);
  communicator->all_gather_values(static_cast<int64_t>(partition->slice_bytes()), "loading");
  report_finished(options, partition->stats().slots, partition->slice_bytes());
  return partition;
}

// direct_io as the config sets it, or (unset: "auto") chosen for this checkpoint: O_DIRECT when
// the page cache cannot keep it beside the weights the model holds in host memory.
storage::DirectChoice direct_io_for(const config::ModelConfig& config, const storage::DiskMap& map) {
  if (const auto forced = config.vram.direct_io)
    return {*forced, *forced ? "O_DIRECT: direct_io = true" : "page cache: direct_io = false"};
  uint64_t held = 0;
  if (config.vram.computation.device == "cpu") held += config.vram.limit.value_or(0);
  if (config.vram.onload.device == "cpu") held += config.vram.onload_limit.value_or(0);
  return storage::choose_direct_io(map.total_bytes(), held, storage::page_cache_room());
}

}  // namespace

LoadedModel load_model(const config::ModelConfig& config, const LoadOptions& options) {
  auto [map, architecture, model, assignments, report] = prepare(config);
  auto direct = direct_io_for(config, map);
  auto source = std::make_shared<WeightSource>(
      WeightSource{std::move(map), std::move(assignments), config.path, direct.direct, std::move(direct.why)});
  const c10::Device device(config.vram.computation.device);
  const auto load_start = Clock::now();
  std::shared_ptr<WeightManager> vram;
  std::shared_ptr<PartitionedWeights> partition;
  if (config.partition.world_size > 1) {
    partition = load_partitioned(config, *model, source, options);
  } else if (config.vram.limit || state_dtype(config.vram.preparing.dtype, model->dtype()) != model->dtype()) {
    vram = std::make_shared<WeightManager>(*model, source, config);
    report_finished(options, source->assignments.size(), report.bytes);
  } else {
    materialise(*source, device, model->dtype(), options, &report.zero_copy);
  }
  model->set_device(device);
  report.load_seconds = seconds_since(load_start);
  return {std::move(model), std::move(report), std::move(source), std::move(vram), std::move(partition), config.vram};
}

namespace {

// Moves every weight of an unmanaged model to `state`; "auto" keeps each weight's dtype.
Transition move_weights(LoadedModel& loaded, const config::DeviceState& state, const LoadOptions& options) {
  const auto start = Clock::now();
  Transition moved;
  const auto& assignments = loaded.source->assignments;
  const bool released = !assignments.empty() && assignments.front().parameter->value.is_meta();
  if (state.device == "disk") {
    for (const auto& a : assignments) {
      if (a.parameter->value.is_meta()) continue;
      moved.bytes += a.parameter->value.nbytes();
      a.parameter->value = at::empty(a.parameter->shape, at::TensorOptions().device(c10::kMeta).dtype(a.parameter->value.scalar_type()));
    }
  } else {
    const c10::Device device(state.device);
    if (released) {
      const auto dtype = state_dtype(state.dtype, assignments.front().parameter->value.scalar_type());
      moved.bytes = materialise(*loaded.source, device, dtype, options, nullptr);
    } else {
      for (const auto& a : assignments) {
        at::Tensor& value = a.parameter->value;
        const auto dtype = state_dtype(state.dtype, value.scalar_type());
        if (value.device() == device && value.scalar_type() == dtype) continue;
        value = value.to(device, dtype);
        moved.bytes += value.nbytes();
      }
    }
  }
  moved.seconds = seconds_since(start);
  return moved;
}

}  // namespace

std::optional<VramStats> vram_stats(const LoadedModel& loaded) {
  if (loaded.partition) return loaded.partition->stats();
  if (loaded.vram) return loaded.vram->stats();
  return std::nullopt;
}

Transition offload(LoadedModel& loaded) {
  const auto start = Clock::now();
  if (loaded.partition) return {loaded.partition->sleep(), seconds_since(start)};
  if (!loaded.vram) return move_weights(loaded, loaded.states.offload, {});
  const uint64_t bytes = loaded.vram->sleep();
  return {bytes, seconds_since(start)};
}

Transition onload(LoadedModel& loaded, const LoadOptions& options) {
  const auto start = Clock::now();
  if (loaded.partition) return {loaded.partition->wake(), seconds_since(start)};
  if (!loaded.vram) {
    const std::string dtype = convert::dtype_torch_name(storage::dtype_of(loaded.model->dtype()));
    return move_weights(loaded, {loaded.states.computation.device, dtype}, options);
  }
  const uint64_t bytes = loaded.vram->wake();
  return {bytes, seconds_since(start)};
}

}  // namespace vramd::model
