#include "server/charges.hpp"

#include <algorithm>

namespace vramd::server {
namespace {

void add(DeviceBytes& to, const config::Device& device, uint64_t bytes) {
  if (!device.is_disk() && bytes) to[device.str()] += bytes;
}

// The model's weights in `dtype` (the model's own where none is named), rounded up.
uint64_t bytes_in(const model::DryRun& dry, const config::Dtype& dtype) {
  const auto model_dtype = storage::parse_torch_dtype(dry.dtype);
  if (!dtype || !model_dtype || !storage::dtype_bits(*model_dtype)) return dry.report.bytes;
  const unsigned from = storage::dtype_bits(*model_dtype), to = storage::dtype_bits(*dtype);
  return static_cast<uint64_t>((static_cast<unsigned __int128>(dry.report.bytes) * to + from - 1) / from);
}

}  // namespace

DeviceBytes computation_charges(const config::ModelConfig& config, const model::DryRun& dry) {
  DeviceBytes out;
  const config::VramConfig& vram = config.vram;
  if (config::rests_for_clients(config)) {  // whole, in host memory, in the onload dtype (GGUF blocks packed)
    add(out, config::Device::named("cpu"), dry.weights ? dry.weights->onload : bytes_in(dry, vram.onload.dtype));
    return out;
  }
  if (!dry.weights) {
    add(out, vram.computation.device, dry.report.bytes);
    return out;
  }
  const model::VramStats& planned = *dry.weights;
  // The limit, not the plan's total: the limit is what the weights promise never to pass, and a
  // model whose packed GGUF layers are unpacked before their ops holds more than its total.
  add(out, vram.computation.device, planned.limit ? planned.limit : planned.total);
  if (!(vram.onload.device == vram.computation.device)) add(out, vram.onload.device, planned.onload);
  add(out, config::Device::named("cpu"), planned.host_experts);  // experts computed on the CPU
  return out;
}

DeviceBytes offload_charges(const config::ModelConfig& config, const model::DryRun& dry) {
  DeviceBytes out;
  add(out, config.vram.offload.device, bytes_in(dry, config.vram.offload.dtype));
  return out;
}

DeviceBytes charges(const DeviceBytes& held, const DeviceBytes& floor, const DeviceBytes& reserved) {
  DeviceBytes out = held;
  for (const auto& [device, bytes] : floor) out[device] = std::max(out[device], bytes);
  for (const auto& [device, bytes] : reserved) out[device] += bytes;
  std::erase_if(out, [](const auto& entry) { return entry.second == 0; });
  return out;
}

}  // namespace vramd::server
