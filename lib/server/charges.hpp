// What a model counts against each device's budget, part by part: one pure function of what its
// weights can hold in the state they are in (weights/holdings.hpp), what they report holding, and
// what it holds back for its job and its clients, so that the daemon's `used`, each model's
// charge in /v1/status, the room made before a job and the eviction planner all count the same
// bytes. Disk is never counted. Torch-free.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "weights/holdings.hpp"

namespace vramd::server {

using DeviceBytes = std::map<std::string, uint64_t>;  // device ("cpu", "cuda:0") -> bytes
using weights::Holdings;

// A model's charge by device and part: `can_hold` (its holdings in their state; none when it
// holds no weights), plus "unplanned" where it reports holding more on a device than those parts
// (no plan should let that happen; counted all the same, never hidden), plus "job" (room
// reserved for the job it runs now or next) and "leases" (what its leases' clients use on their
// devices). Parts of no bytes are left out.
Holdings charge(const Holdings& can_hold, const DeviceBytes& held, const DeviceBytes& job, const DeviceBytes& leases);

// The bytes on `device` of `bytes`, 0 where it has none.
uint64_t on(const DeviceBytes& bytes, const std::string& device);

}  // namespace vramd::server
