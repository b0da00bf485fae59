// Loading a model from its config: build the architecture on the meta device, map checkpoint
// tensors to parameters (through the converter when there is one), then materialise each
// parameter straight into its device and dtype, one tensor at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "config/model_config.hpp"
#include "model/dry_run.hpp"
#include "model/model.hpp"
#include "util/error.hpp"

namespace vramd::model {

struct Progress {
  std::string_view tensor;  // the parameter just loaded
  uint64_t bytes_done = 0, bytes_total = 0;
  size_t tensors_done = 0, tensors_total = 0;
};

struct LoadOptions {
  // Called after each tensor; returning false cancels the load, which then throws Cancelled
  // and frees everything it allocated.
  std::function<bool(const Progress&)> progress;
  // CPU weights whose checkpoint bytes already have the right dtype and alignment are views of
  // the file's private mapping instead of copies. The file must then not be overwritten in
  // place while the model lives (replacing it by rename is fine).
  bool zero_copy = true;
};

struct LoadedModel {
  std::unique_ptr<Model> model;
  LoadReport report;
};

class Cancelled : public Error {
 public:
  using Error::Error;
};

// Throws Error naming the config and every missing, unexpected or mismatched key at once.
LoadedModel load_model(const config::ModelConfig& config, const LoadOptions& options = {});

}  // namespace vramd::model
