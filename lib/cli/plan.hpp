// `vramctl plan`: where a model's weights would go across GPUs, host memory and disk under
// byte budgets (model/device_map.hpp), found from the model built on the meta device, reading
// no tensor data.
#pragma once

#include <iosfwd>
#include <string>

namespace vramd::cli {

struct PlanOptions {
  std::string config;
  std::string daemon_config;  // as for check
  std::string max_memory;     // "cuda:0=2GiB,cpu=8GiB"
  std::string dtype;          // the planning dtype; empty: the model's (its computation dtype)
  // "sequential": accelerate's infer_auto_device_map on max_memory; "balanced", "balanced_low_0":
  // on max_memory as its get_balanced_memory lowers it (model::balanced_memory)
  std::string strategy = "sequential";
  bool json = false;
};

// Prints the map: one row per unit (runs of blocks on one device collapsed), then each device's
// total and reserve. Throws vramd::Error naming the option, config or key at fault.
void plan(const PlanOptions& options, std::ostream& out, std::ostream& err);

}  // namespace vramd::cli
