// Loading a model from its config: build the architecture on the meta device, map checkpoint
// tensors to parameters (through the converter when there is one), then materialise each
// parameter straight into its device and dtype, one tensor at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
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

}  // namespace vramd::model
