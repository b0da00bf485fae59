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

// Pages of checkpoints that several loaded models view (weights that are views of a file's
// mapping, model::FileSpans) are counted once: each model's charge counts its views in full, and
// the daemon's `used` counts on "cpu" the sum of the charges less `shared_views`, the bytes
// viewed by more than one (the sum of each model's views less their union).
uint64_t shared_views(const std::vector<const Entry*>& entries);
// The bytes of `views` that loaded models other than `self` view now.
uint64_t viewed_by_others(const model::FileSpans& views, const std::vector<const Entry*>& entries, const Entry* self);
// What freeing the values an update of the entry replaced gives back (`replaced`, by device:
// weights::Weights::take_replaced's): on "cpu", less the checkpoint pages they viewed that other
// loaded models view too. Those stay counted in the others' charges, and no longer as shared,
// once the entry's views are `after` the update's.
DeviceBytes freed_by_release(DeviceBytes replaced, const Entry& entry, const model::FileSpans& after,
                             const std::vector<const Entry*>& entries);
// The bytes of the copies on the host that the entry's weights share with other loaded models
// (weights/copy_key.hpp): what a lease on "cpu" packs into memory of its own that it can hand
// over, while the others keep theirs (weights/lease_memory.cpp).
uint64_t shared_copies(const Entry& entry, const std::vector<const Entry*>& entries);
// The views a load of the entry would hold (its dry run's): the copies it would share with other
// configs of the checkpoint (`copies`: none for a load that a lease on "cpu" packs), and the
// checkpoint's pages where its reads go through the page cache (direct_io = false, or "auto"
// with room in the cache for its checkpoint now).
model::FileSpans views_to_come(const Entry& entry, bool copies = true);

// Whether `more` fits beside `used` within every budget.
bool fits(const DeviceBytes& more, const DeviceBytes& used, const Budgets& budgets);

// The room a job must reserve: what the entry will hold (`expected`) less what it counts there
// now (`have`), plus `extra` (a lease's room for its client), by device.
DeviceBytes room_to_reserve(const DeviceBytes& expected, const DeviceBytes& have, const DeviceBytes& extra);

// The entry as the eviction planner sees it on `device`; `offload_fits`: its offload state
// fits where it sleeps now; `kept`: of its views, the bytes that others view too, the model room
// is made for included (its eviction frees none of those).
Holder holder_on(const Entry& entry, const std::string& device, bool offload_fits, uint64_t kept);

}  // namespace vramd::server
