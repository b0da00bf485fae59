// Loading a model from its config: build the architecture on the meta device, map checkpoint
// tensors to parameters (through the converter when there is one), then materialise each
// parameter straight into its device and dtype, one tensor at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "model/dry_run.hpp"
#include "model/model.hpp"
#include "model/progress.hpp"
#include "model/vram_stats.hpp"
#include "util/error.hpp"

namespace vramd::dist {
class Group;
}

namespace vramd::weights {
struct Source;
class Weights;
}  // namespace vramd::weights

namespace vramd::model {

struct LoadOptions {
  // Called after each tensor; returning false (before the last one) cancels the load, which then throws Cancelled
  // and frees everything it allocated.
  std::function<bool(const Progress&)> progress;
  // CPU weights whose checkpoint bytes already have the right dtype and alignment are views of
  // the file's private mapping instead of copies. The file must then not be overwritten in
  // place while the model lives (replacing it by rename is fine).
  bool zero_copy = true;
  // For a config with [partition]: the group of processes to partition across (every rank
  // loads the same config with the same `partition_name`, which names its collectives).
  std::shared_ptr<dist::Group> group;
  std::string partition_name;
};

struct LoadedModel {
  std::unique_ptr<Model> model;
  LoadReport report;
  std::shared_ptr<weights::Source> source;    // the checkpoint and the expressions that fill each parameter
  std::shared_ptr<weights::Weights> weights;  // where they are and how ops get them (weights/weights.hpp)
};

// dry_run (model/dry_run.hpp), keeping the model it built on the meta device: names, shapes and
// ties, no tensor data. For planning where the weights would go (vramctl plan).
struct DryModel {
  DryRun dry;
  std::unique_ptr<Model> model;
};
DryModel dry_run_model(const config::ModelConfig& config);

// Throws Error naming the config and every missing, unexpected or mismatched key at once.
LoadedModel load_model(const config::ModelConfig& config, const LoadOptions& options = {});

// Whole-model sleep: every weight to the offload state ("disk" releases them; they are re-read
// from the checkpoint through the converter's expressions when needed), the computation
// device freed. Wake: back to how load_model left them. Each reports the bytes moved.
Transition offload(LoadedModel& loaded);
Transition onload(LoadedModel& loaded);

// An update's tensors do not fit the model (the message names the tensor and why), or its
// file cannot be read: the request's fault, HTTP 400.
class BadUpdate : public Error {
 public:
  using Error::Error;
};

struct UpdateReport {
  size_t tensors = 0;  // parameters given new values
  uint64_t bytes = 0;  // of those values, as the model holds them
};

// Where an update's new values may go (weights::WeightUpdate): `room`, bytes by device reserved
// for values written beside the old ones; `shared_in_place`, whether weights in a lease's GPU
// memory take them where they are (no lease that keeps its values holds it).
struct UpdateSpace {
  std::map<std::string, uint64_t> room;
  bool shared_in_place = false;
};

// New values for some of a loaded, awake model's weights, checked whole (every name a
// parameter's, every shape its shape, every dtype floating, none twice) before any weight
// changes, then swapped in as one step (weights::Weights::update). Tied parameters take their
// values through the parameter they are tied to, as at load; names the architecture ignores
// are skipped as at load. Throws BadUpdate naming `where` and every tensor at fault;
// weights::NotUpdatable where the weights cannot take an update.
//
// `safetensors`: a file's bytes whose tensors are named as the model's parameters (as a
// lease's manifest names them), which cannot change while they are read (the request's body, a
// sealed memfd), so that weights may take them in place; `where` names them in errors.
// `before_write` runs once every value is read and checked, before any weight takes one.
// `shared`, where given, owns the bytes, which are sealed shared memory: weights may keep views
// of them as their values (weights::WeightUpdate::adopt), and keep `shared` alive while they do.
UpdateReport update_from_bytes(LoadedModel& loaded, const config::ModelConfig& config, std::span<const std::byte> safetensors,
                               const std::string& where, const UpdateSpace& space,
                               std::function<void()> before_write = {}, std::shared_ptr<void> shared = {});
// `path`: a checkpoint read as the config's is (its readers, prefix and converter), holding
// some or all of the tensors that checkpoint holds.
// Both take `space` (above), and throw weights::UpdateNeedsRoom when its room is not enough.
UpdateReport update_from_checkpoint(LoadedModel& loaded, const config::ModelConfig& config, const std::string& path,
                                    const UpdateSpace& space);
// The checkpoint at `path`, read as update_from_checkpoint reads it, as the bytes of one
// safetensors file of its converted tensors (for update_from_bytes): what rank 0 of a
// partitioned model hands the other ranks. Throws BadUpdate naming the file.
std::string checkpoint_as_safetensors(const LoadedModel& loaded, const config::ModelConfig& config, const std::string& path);

}  // namespace vramd::model
