// What the daemon counts against each device's budget, and what fits there: pure decisions over
// the models' entries (server/entry.hpp) and their charges (server/charges.hpp), which the
// registry acts on (making room, reserving it, evicting: server/eviction.hpp plans which).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "model/load_report.hpp"
#include "model/vram_stats.hpp"
#include "server/charges.hpp"
#include "server/entry.hpp"
#include "server/eviction.hpp"

namespace vramd::server {

using Budgets = std::map<std::string, uint64_t>;  // device -> bytes; a device without one is limited by its size

// What a model's weights can hold in the state they are in (weights/holdings.hpp): awake, what
// its plan (`loaded`'s once loaded, else the dry run's) can fill; asleep, `held` where they
// sleep, which cannot grow; while an unload or a new config's load frees them on the worker
// (`loaded` false, something still `held`), that ("freeing"); none once unloaded.
Holdings holdings_of(const config::ModelConfig* config, const model::DryRun* dry, bool loaded, ModelState state,
                     const DeviceBytes& held, const std::optional<model::VramStats>& plan);

// What the entry counts against each device's budget, by part: its weights' holdings, what
// they hold past them, what it holds back for its job and its leases' clients, and the memfds
// kept for its updates. `used` is the sum of these and of the values being freed.
Holdings charged(const Entry& entry);
// The same without what it holds back (its job's room, its clients' use).
DeviceBytes held_charges(const Entry& entry);
// What the entry's leases' clients use on their devices.
DeviceBytes lease_room(const Entry& entry);

// Whether `more` fits beside `used` within every budget.
bool fits(const DeviceBytes& more, const DeviceBytes& used, const Budgets& budgets);

// The room a job must reserve: what the entry will hold (`expected`) less what it counts there
// now (`have`), plus `extra` (a lease's room for its client), by device.
DeviceBytes room_to_reserve(const DeviceBytes& expected, const DeviceBytes& have, const DeviceBytes& extra);

// The entry as the eviction planner sees it on `device`; `offload_fits`: its offload state
// fits where it sleeps now.
Holder holder_on(const Entry& entry, const std::string& device, bool offload_fits);

}  // namespace vramd::server
