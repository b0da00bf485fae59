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

// A unit of residency for a client's manager: one weight-holding module and its tensors.
struct ManagedUnit {
  std::string name;                  // the module: "down_blocks.0.resnets.1.conv1"
  std::vector<std::string> tensors;  // its tensors' names, as in the manifest
  uint64_t resting = 0;              // bytes as leased (the onload dtype, or packed GGUF blocks)
  uint64_t computed = 0;             // bytes in the computation dtype
};

// For a model that rests for its clients (config::rests_for_clients): where and in which dtype
// its clients compute, the limit each may hold there, and its units.
struct ManagedPlan {
  std::string device;  // the computation device: "cuda:0", "cpu"
  std::string dtype;   // the computation dtype
  std::optional<uint64_t> limit;
  std::vector<ManagedUnit> units;
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
  // What a lease would hand over (GET /v1/models/NAME/plan), found without loading: every
  // tensor's name, in the manifest's order, and for a model that rests for its clients its plan.
  std::vector<std::string> names;
  std::optional<ManagedPlan> plan;
};

// Neither the model config nor a config.json beside the checkpoint names an architecture.
class NoArchitecture : public Error {
 public:
  using Error::Error;
};

}  // namespace vramd::model
