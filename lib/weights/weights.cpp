#include "weights/weights.hpp"

#include "dist/communicator.hpp"
#include "model/load_options.hpp"
#include "weights/loaded_model.hpp"
#include "weights/lease.hpp"
#include "weights/partitioned.hpp"
#include "weights/resident.hpp"
#include "weights/source.hpp"
#include "weights/streamed.hpp"
#include "storage/tensor_io.hpp"
#include "util/format.hpp"

namespace vramd::weights {
namespace {

// Tells `options.progress` the load is done in one step (streamed and partitioned weights are
// read as they are needed, not tensor by tensor while loading).
void report_finished(const model::LoadOptions& options, size_t tensors, uint64_t bytes) {
  if (!options.progress) return;
  model::Progress done;
  done.tensors_done = done.tensors_total = tensors;
  done.bytes_done = done.bytes_total = bytes;
  options.progress(done);
}

// This rank's slices, once every rank of the group has joined; returns when all have read theirs.
std::shared_ptr<Weights> partitioned(model::Model& model, std::shared_ptr<Source> source, const config::ModelConfig& config,
                                     const model::LoadOptions& options) {
  const int ranks = config.partition.world_size;
  if (!options.group)
    fail(config::where(config, "partition.world_size"), "[partition].world_size = " + std::to_string(ranks) + " needs a group of " + std::to_string(ranks) +
                          " vramd processes, and this one runs alone (start them as torchrun does, with RANK, WORLD_SIZE, "
                          "MASTER_ADDR and MASTER_PORT, or try `vramctl run --ranks " + std::to_string(ranks) + "`)");
  if (options.group->size() != ranks)
    fail(config::where(config, "partition.world_size"), "[partition].world_size = " + std::to_string(ranks) + ", but this group has " +
                          std::to_string(options.group->size()) + " ranks");
  const std::string name = options.partition_name.empty() ? "load/" + config.name : options.partition_name;
  auto communicator = std::make_shared<dist::Communicator>(options.group, name, config.partition.timeout);
  auto weights = std::make_shared<PartitionedWeights>(model, std::move(source), config, communicator);
  communicator->all_gather_values(static_cast<int64_t>(weights->slice_bytes()), "loading");
  report_finished(options, weights->stats()->slots, weights->slice_bytes());
  return weights;
}

// Layer by layer under a limit, or prepared in a dtype of their own, or held packed in some
// state (a resident model that sleeps packed, too).
bool streams(const model::Model& model, const config::ModelConfig& config) {
  const auto& vram = config.vram;
  return vram.limit || vram.experts_on_cpu || state_dtype(vram.preparing.dtype, model.dtype()) != model.dtype() ||
         packed_state(vram.preparing, config) || packed_state(vram.onload, config) || packed_state(vram.offload, config);
}

}  // namespace

namespace {

// A model that rests for its clients (managed_plan): each client computes one unit whole at a
// time, so the limit must hold the largest in the computation dtype.
model::VramStats plan_for_clients(const model::Model& model, const Source& source, const config::ModelConfig& config) {
  const ManagedPlan plan = managed_plan(model, source, config);
  model::VramStats stats;
  stats.limit = plan.limit.value_or(0);
  stats.slots = plan.units.size();
  uint64_t largest = 0;
  for (const auto& unit : plan.units) {
    largest = std::max(largest, unit.computed);
    stats.total += unit.computed;
  }
  if (stats.limit && largest > stats.limit)
    fail(config::where(config, "vram.limit"), "vram.limit = " + format_bytes(stats.limit) + " cannot hold the largest unit (" +
                          format_bytes(largest) + " in " + plan.dtype +
                          "), which each client that manages the model computes whole; raise it to at least that");
  // What rests in host memory: the onload dtype, GGUF blocks packed where that state keeps them.
  const c10::ScalarType dtype = state_dtype(config.vram.onload.dtype, model.dtype());
  const bool packed = packed_state(config.vram.onload, config);
  bool any_packed = false;
  for (const auto& a : source.assignments) {
    const c10::ScalarType held = held_dtype(a, dtype, packed);
    stats.onload += held_bytes(a, held);
    any_packed = any_packed || held == kPacked;
  }
  stats.plan = "rests in host memory in " + storage::torch_name(dtype) + (any_packed ? " and packed GGUF blocks" : "") +
               " (" + format_bytes(stats.onload) + ") for the clients that manage it: " + counted(stats.slots, "unit") +
               ", the largest " + format_bytes(largest) + " in " + plan.dtype + " on " + plan.device +
               (stats.limit ? "; limit " + format_bytes(stats.limit) : "");
  return stats;
}

}  // namespace

NotUpdatable packed_not_updatable(const std::string& model, const std::string& weight) {
  return NotUpdatable("model " + quote(model) + " holds " + quote(weight) + " as packed GGUF blocks, which take no " +
                      "update of plain values: keep them unpacked (packed = false) to update it");
}

std::optional<model::VramStats> plan_weights(const model::Model& model, const Source& source,
                                             const config::ModelConfig& config) {
  if (config.partition.world_size > 1) return std::nullopt;
  check_packed(source, config);
  if (config::rests_for_clients(config)) return plan_for_clients(model, source, config);
  if (!streams(model, config)) return std::nullopt;
  return StreamedWeights::plan(model, source, config);
}

model::FileSpans planned_views(const model::Model& model, const Source& source, const config::ModelConfig& config) {
  if (config.partition.world_size > 1 || (!config::rests_for_clients(config) && streams(model, config))) return {};
  return ResidentWeights::planned_views(model, source, config);
}

std::shared_ptr<Weights> make_weights(model::Model& model, std::shared_ptr<Source> source,
                                      const config::ModelConfig& config, const model::LoadOptions& options,
                                      model::LoadReport& report) {
  if (config.partition.world_size > 1) return partitioned(model, std::move(source), config, options);
  check_packed(*source, config);
  // Its clients stream the weights; here they rest whole in host memory (ResidentWeights::resting).
  if (config::rests_for_clients(config))
    return std::make_shared<ResidentWeights>(model, std::move(source), config, options, report.zero_copy);
  if (streams(model, config)) {
    const size_t tensors = source->assignments.size();
    auto weights = std::make_shared<StreamedWeights>(model, std::move(source), config);
    report_finished(options, tensors, report.bytes);
    return weights;
  }
  return std::make_shared<ResidentWeights>(model, std::move(source), config, options, report.zero_copy);
}

}  // namespace vramd::weights
