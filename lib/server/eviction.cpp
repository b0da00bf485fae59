#include "server/eviction.hpp"

#include <algorithm>

#include "util/format.hpp"

namespace vramd::server {
namespace {

bool evictable(const Holder& h) { return h.loaded && !h.busy && !h.waiting_for_room && !h.pinned && !h.leased; }

const char* why_held(const Holder& h) {
  if (h.pinned) return "pinned";
  if (h.leased) return "leased";
  return h.busy ? "busy" : "idle";
}

}  // namespace

RoomPlan plan_room(const RoomRequest& request, const std::vector<Holder>& holders) {
  const std::string what = "model " + quote(request.model) + " needs " +
                           format_bytes_beside(request.bytes, request.budget) + " on " + request.device;
  if (request.bytes > request.budget)
    return {{}, what + ", more than the daemon's whole budget for it (" +
                    format_bytes_beside(request.budget, request.bytes) + ")"};
  uint64_t in_use = 0;
  for (const auto& h : holders) in_use += h.bytes + h.reserved;
  in_use -= std::min(in_use, request.shared);
  const uint64_t free = request.budget - std::min(request.budget, in_use);
  if (free >= request.bytes) return {};

  std::vector<const Holder*> candidates;
  for (const auto& h : holders)
    if (h.name != request.model && evictable(h) && h.bytes > h.shared) candidates.push_back(&h);
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Holder* a, const Holder* b) { return a->last_used < b->last_used; });
  RoomPlan plan;
  uint64_t planned = 0;
  std::vector<const Holder*> chosen;
  const auto evict = [&](const Holder* h, Eviction::Kind kind) {
    planned += h->bytes - h->shared;
    chosen.push_back(h);
    plan.evictions.push_back({kind, h->name, h->bytes - h->shared});
  };
  for (const Holder* h : candidates)  // first sleep models whose offload state is elsewhere
    if (free + planned < request.bytes && h->ready && h->offload_fits && h->offload_device != request.device)
      evict(h, Eviction::Kind::Offload);
  for (const Holder* h : candidates)  // then unload
    if (free + planned < request.bytes && std::find(chosen.begin(), chosen.end(), h) == chosen.end())
      evict(h, Eviction::Kind::Unload);
  if (free + planned >= request.bytes) return plan;

  std::string in_use_by;
  for (const auto& h : holders) {
    const uint64_t held = h.bytes + h.reserved;
    if (!held || h.name == request.model) continue;
    in_use_by += (in_use_by.empty() ? "" : ", ") + h.name + " " + format_bytes(held) + " (" + why_held(h) + ")";
  }
  return {{},
          what + " but only " + format_bytes_beside(free + planned, request.bytes) + " of its budget of " +
              format_bytes(request.budget) +
              " can be freed; in use: " + (in_use_by.empty() ? "nothing else" : in_use_by)};
}

}  // namespace vramd::server
