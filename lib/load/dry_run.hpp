// What loading a model would do, found without reading tensor data: for `vramctl check`, `vramctl
// plan` and the daemon's validation of configs. LibTorch-free (the daemon's loop side calls it).
#pragma once

#include <memory>

#include "config/model_config.hpp"
#include "model/load_report.hpp"

namespace vramd::model {
class Model;
}

namespace vramd::load {

// Opens the index, runs the converter, builds the model on the meta device, matches names,
// shapes and dtypes, and plans where the weights go. Throws the Error load_model would.
model::DryRun dry_run(const config::ModelConfig& config);

// dry_run, keeping the model it built on the meta device: names, shapes and ties, no tensor
// data. For planning where the weights would go (vramctl plan); its callers include LibTorch.
struct DryModel {
  model::DryRun dry;
  std::unique_ptr<model::Model> model;
};
DryModel dry_run_model(const config::ModelConfig& config);

}  // namespace vramd::load
