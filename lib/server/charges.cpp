#include "server/charges.hpp"

namespace vramd::server {

Holdings charge(const Holdings& can_hold, const DeviceBytes& held, const DeviceBytes& job, const DeviceBytes& leases) {
  Holdings out = can_hold;
  const DeviceBytes planned = weights::totals(can_hold);
  for (const auto& [device, bytes] : held)
    if (bytes > on(planned, device)) out[device]["unplanned"] = bytes - on(planned, device);
  for (const auto& [device, bytes] : job) out[device]["job"] += bytes;
  for (const auto& [device, bytes] : leases) out[device]["leases"] += bytes;
  for (auto& [device, parts] : out) std::erase_if(parts, [](const auto& part) { return part.second == 0; });
  std::erase_if(out, [](const auto& entry) { return entry.second.empty(); });
  return out;
}

uint64_t on(const DeviceBytes& bytes, const std::string& device) {
  const auto it = bytes.find(device);
  return it == bytes.end() ? 0 : it->second;
}

}  // namespace vramd::server
