// What a load reports, and what a dry run finds (load/dry_run.hpp), without LibTorch: for
// `vramctl check`, the daemon's validation of configs, and the budgets (weights/holdings.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "model/file_spans.hpp"
#include "model/vram_stats.hpp"
#include "util/error.hpp"

namespace vramd::model {

// A LoRA adapter as the load read it ([[lora]], load/lora.hpp).
struct AdapterReport {
  std::string path;
  double scale = 1;
  std::string format;  // "peft", "kohya", "diffusers"
  size_t modules = 0;  // weights it changes
  uint64_t bytes = 0;  // held in host memory while the model is loaded (float32)
};

struct LoadReport {
  std::string checkpoint;                    // the sources, as DiskMap describes them
  std::vector<std::string> missing;          // parameters the checkpoint lacks (strict = false)
  std::vector<std::string> unexpected;       // checkpoint tensors no parameter takes (strict = false)
  std::vector<std::string> warnings;         // from the checkpoint index
  std::vector<std::string> printed;          // by the converter
  uint64_t bytes = 0;                        // of the loaded weights (tied ones once)
  size_t tensors = 0;
  size_t zero_copy = 0;                      // tensors that are views of the checkpoint mapping
  uint64_t largest = 0;                      // bytes of the largest tensor
  std::vector<AdapterReport> adapters;       // [[lora]], in order
  double plan_seconds = 0, load_seconds = 0;  // index + converter + build; reading
};

struct DryRun {
  std::string architecture;
  std::string dtype;  // of weights and activations once loaded
  LoadReport report;  // without load_seconds and zero_copy
  // Streamed weights' plan ([vram].limit, or a preparing dtype of its own): the figures and
  // plan line the model's status shows once loaded, before its first forward.
  std::optional<VramStats> weights;
  // The checkpoint's bytes the weights would hold as views of its pages in host memory (shared
  // with every other model viewing them: server/budget.hpp), and whether reading through the
  // page cache was the config's choice (direct_io = false) rather than the checkpoint's size
  // against the cache's room, which the daemon asks again before it counts on the views.
  FileSpans views;
  bool views_chosen = false;
  uint64_t checkpoint_bytes = 0;  // of every tensor in the checkpoint's index
};

// Neither the model config nor a config.json beside the checkpoint names an architecture.
class NoArchitecture : public Error {
 public:
  using Error::Error;
};

}  // namespace vramd::model
