// What a model counts against each device's budget: one pure function of its config, its dry
// run and what it reports holding, so that the daemon's `used`, each model's share in
// /v1/status, the room made before a job and the eviction planner all count the same bytes.
// Disk is never counted. Torch-free.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "config/model_config.hpp"
#include "model/dry_run.hpp"

namespace vramd::server {

using DeviceBytes = std::map<std::string, uint64_t>;  // device ("cpu", "cuda:0") -> bytes

// What a model holds once in its computation state (loaded, or woken): a resident model its
// weights on the computation device; a streamed one its [vram].limit there (any forward may fill
// it, so the budget counts all of it for as long as the model is loaded) and its streamed
// layers' onload copies on the onload device.
DeviceBytes computation_charges(const config::ModelConfig& config, const model::DryRun& dry);

// What putting a model to sleep places on its offload device: its weights in the offload dtype
// (the model's own where the offload state names none). Empty when they sleep on disk.
DeviceBytes offload_charges(const config::ModelConfig& config, const model::DryRun& dry);

// A model's charge: on each device what it reports holding, at least `floor` (its computation
// charges while it holds its weights in their computation state, else nothing), plus what is
// reserved there for the job it runs now.
DeviceBytes charges(const DeviceBytes& held, const DeviceBytes& floor, const DeviceBytes& reserved);

}  // namespace vramd::server
