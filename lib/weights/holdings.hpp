// What a model's weights can hold on each device, part by part: the one count from which the
// daemon's charges, its status and `vramctl check` all come (server/charges.hpp adds what a
// model holds back for its jobs and clients). A pure function of the config, the dry run and,
// once loaded, the weights' own plan; LibTorch-free. Disk is never counted.
//
// A part is counted at the most it can hold while the model is in that state, never at what it
// holds at a moment, so that a model cannot grow past its charge between two looks at it: a
// streamed model's whole limit from its load on, however little a forward has filled yet.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "config/model_config.hpp"
#include "model/load_report.hpp"
#include "model/vram_stats.hpp"

namespace vramd::weights {

// Bytes by part ("limit", "onload"), on one device.
using Parts = std::map<std::string, uint64_t>;
// Parts by device ("cpu", "cuda:0").
using Holdings = std::map<std::string, Parts>;

// The pinned host memory a model streamed on a GPU reads its layers through, for as long as it
// is loaded (storage::DeviceStaging: 16 buffers of 8 MiB, which weights/streamed.cpp checks).
inline constexpr uint64_t kHostStagingBytes = 16 * (8u << 20);

// What the model can hold in its computation state (loaded, or woken), by device and part:
//   weights       every weight, resident on the computation device
//   limit         streamed or partitioned weights under [vram].limit on the computation device:
//                 resident layers, layers streamed in, their computation copies, buffers kept
//   onload        streamed layers resting on the onload device (its dtype, GGUF blocks packed
//                 where it keeps them), on whatever device that is, the computation one included
//   experts       experts computed on the CPU ([vram].experts = "cpu")
//   host_staging  pinned host buffers reads to a GPU go through (kHostStagingBytes)
//   resting       a model that rests whole in host memory for its clients (architecture "weights")
//   adapters      its LoRA adapters' factors, in host memory (awake and asleep alike)
// `loaded`: the plan of the loaded weights (Runtime::vram), which replaces the dry run's: a
// partitioned model's is made only when its group loads it.
Holdings awake_holdings(const config::ModelConfig& config, const model::DryRun& dry,
                        const std::optional<model::VramStats>& loaded = std::nullopt);

// What putting the model to sleep places on its offload device, as `offload`: its weights in the
// offload dtype (the model's own where the offload state names none). Empty when they sleep on disk.
Holdings asleep_holdings(const config::ModelConfig& config, const model::DryRun& dry);

// The bytes of every part on each device.
std::map<std::string, uint64_t> totals(const Holdings& holdings);

// Throws Error naming the config's line and key when what the model can hold in its
// computation state is more on a device than the daemon's whole budget for it: the load would be
// refused. `vramctl check`, `vramd --check` and the daemon's validation of its folder call it.
void check_budgets(const config::ModelConfig& config, const model::DryRun& dry, const config::DaemonConfig& daemon);

}  // namespace vramd::weights
