#include "weights/holdings.hpp"

#include <algorithm>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::weights {
namespace {

void add(Holdings& to, const config::Device& device, const char* part, uint64_t bytes) {
  if (!device.is_disk() && bytes) to[device.str()][part] += bytes;
}

// The model's weights in `dtype` (the model's own where none is named), rounded up.
uint64_t bytes_in(const model::DryRun& dry, const config::Dtype& dtype) {
  const auto model_dtype = storage::parse_torch_dtype(dry.dtype);
  if (!dtype || !model_dtype || !storage::dtype_bits(*model_dtype)) return dry.report.bytes;
  const unsigned from = storage::dtype_bits(*model_dtype), to = storage::dtype_bits(*dtype);
  return static_cast<uint64_t>((static_cast<unsigned __int128>(dry.report.bytes) * to + from - 1) / from);
}

const config::Device kCpu = config::Device::named("cpu");

// The factors of the model's LoRA adapters while it is loaded: in host memory (fused), or on the
// computation device in its dtype (unfused; counted at float32's size, never less).
void add_adapters(Holdings& to, const config::ModelConfig& config, const model::DryRun& dry) {
  if (config::clients_apply_adapters(config)) return;  // the clients hold them
  for (const auto& adapter : dry.report.adapters)
    add(to, config.fuse_lora ? kCpu : config.vram.computation.device, "adapters", adapter.bytes);
}

Holdings weights_awake(const config::ModelConfig& config, const model::DryRun& dry,
                       const std::optional<model::VramStats>& loaded) {
  Holdings out;
  const config::VramConfig& vram = config.vram;
  const std::optional<model::VramStats>& plan = loaded ? loaded : dry.weights;
  if (config::rests_for_clients(config)) {  // whole, in host memory, in the onload dtype (GGUF blocks packed)
    add(out, kCpu, "resting", plan ? plan->onload : bytes_in(dry, vram.onload.dtype));
    return out;
  }
  if (!plan) {
    add(out, vram.computation.device, "weights", dry.report.bytes);
    return out;
  }
  // The limit, not the plan's total: the limit is what the weights promise never to pass, and a
  // model whose packed GGUF layers are unpacked before their ops holds more than its total.
  // Without one: what stays prepared, and the room kept for computation copies.
  add(out, vram.computation.device, "limit", plan->limit ? plan->limit : plan->resident + plan->streaming);
  add(out, vram.onload.device, "onload", plan->onload);
  add(out, kCpu, "experts", plan->host_experts);
  if (!vram.computation.device.is_cpu() && plan->slots > plan->resident_slots + plan->host_expert_slots)
    add(out, kCpu, "host_staging", kHostStagingBytes);  // what its streamed layers are read through
  return out;
}

}  // namespace

Holdings awake_holdings(const config::ModelConfig& config, const model::DryRun& dry,
                        const std::optional<model::VramStats>& loaded) {
  Holdings out = weights_awake(config, dry, loaded);
  add_adapters(out, config, dry);
  return out;
}

Holdings asleep_holdings(const config::ModelConfig& config, const model::DryRun& dry) {
  Holdings out;
  add(out, config.vram.offload.device, "offload", bytes_in(dry, config.vram.offload.dtype));
  add_adapters(out, config, dry);
  return out;
}

std::map<std::string, uint64_t> totals(const Holdings& holdings) {
  std::map<std::string, uint64_t> out;
  for (const auto& [device, parts] : holdings)
    for (const auto& [part, bytes] : parts) out[device] += bytes;
  return out;
}

void check_budgets(const config::ModelConfig& config, const model::DryRun& dry, const config::DaemonConfig& daemon) {
  const Holdings holdings = awake_holdings(config, dry);
  for (const auto& [device, bytes] : totals(holdings)) {
    const auto budget = daemon.budgets.find(device);
    if (budget == daemon.budgets.end() || bytes <= budget->second) continue;
    const Parts& here = holdings.at(device);
    std::string parts;
    for (const auto& [part, n] : here) parts += (parts.empty() ? "" : ", ") + part + " " + format_bytes(n);
    // Named at the key that decides its largest part there: the one to change.
    const auto largest =
        std::max_element(here.begin(), here.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    const std::string key = largest->first == "limit"    ? "vram.limit"
                            : largest->first == "onload" ? (config.vram.onload_limit ? "vram.onload_limit" : "vram.onload")
                            : largest->first == "experts" ? "vram.experts"
                            : largest->first == "weights" ? "checkpoint"
                                                          : "vram";
    fail(config::where(config, key),
         "model " + quote(config.name) + " holds up to " + format_bytes_beside(bytes, budget->second) + " on " + device +
             " (" + parts + "), more than the daemon's whole budget for it (" +
             format_bytes_beside(budget->second, bytes) + (daemon.path.empty() ? "" : ", " + daemon.path) +
             "): it could never load; " +
             (config.vram.limit ? "lower vram.limit, rest its layers elsewhere (onload)" : "give it a [vram] limit") +
             " or raise the budget");
  }
}

}  // namespace vramd::weights
