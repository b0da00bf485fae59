// The one place the registry's state becomes JSON (docs/api.md): a model's entry
// (GET /v1/models/NAME), its line in GET /v1/status and the devices there, its weights' plan and
// counters, its leases, a lease's manifest and a load's progress. Read on the loop thread only.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "server/json_out.hpp"
#include "server/registry.hpp"
#include "weights/lease.hpp"

namespace vramd::server {

// Everything about the model: state, config, the dry run's figures, weights, leases, progress, stats.
nlohmann::json entry_json(const Entry& entry);
// GET /v1/status's parts, written as text (it is asked for often): a model's line (state,
// devices, queue, placement, weights, leases; `charge` is its charged(), server/budget.hpp, which
// the status counts once for the devices too), and the devices' budgets and use.
void write_summary(JsonOut& out, const Entry& entry, const Holdings& charge);
void write_devices(JsonOut& out, const std::map<std::string, DeviceUse>& devices);
// "pid 42 (uid 1000, cpu, since 2026-12-01T12:00:01Z), ...": who holds the model's leases.
std::string holders(const Entry& entry);
nlohmann::json progress_json(const LoadProgress& progress);
// What a client maps: regions in the order their descriptors travel, and every tensor's place;
// one line of JSON (written straight into the text: a manifest of hundreds of tensors is sent at
// every version a following lease takes).
std::string manifest_line(const weights::Manifest& manifest, const std::string& model, std::optional<uint64_t> lease);
// A managed model's plan (docs/api.md, lease): {"device", "dtype", "limit", "units"}.
nlohmann::json plan_json(const weights::ManagedPlan& plan);
// GET /v1/models/NAME/plan: what a lease would hand over, from the config's dry run (nothing
// loaded): {"model", "names", "plan"}. The entry's config is valid.
nlohmann::json dry_plan_json(const Entry& entry);

}  // namespace vramd::server
