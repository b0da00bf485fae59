#include "server/budget.hpp"

#include <algorithm>

#include "storage/page_cache.hpp"
#include "weights/copy_key.hpp"
#include "weights/holdings.hpp"

namespace vramd::server {

Holdings holdings_of(const config::ModelConfig* config, const model::DryRun* dry, bool loaded, ModelState state,
                     const DeviceBytes& held, const std::optional<model::VramStats>& plan) {
  Holdings out;
  if (!loaded || state == ModelState::Offloaded) {
    for (const auto& [device, bytes] : held) out[device][loaded ? "offload" : "freeing"] = bytes;
    return out;
  }
  return config && dry ? weights::awake_holdings(*config, *dry, plan) : out;
}

namespace {

Holdings holdings(const Entry& e) {
  return holdings_of(e.config ? &*e.config : nullptr, e.dry ? &*e.dry : nullptr, e.runtime != nullptr, e.state, e.bytes,
                     e.vram);
}

}  // namespace

DeviceBytes lease_room(const Entry& e) {
  DeviceBytes reserved;
  for (const auto& [id, lease] : e.leases)
    for (const auto& [device, bytes] : lease.reserved) reserved[device] += bytes;
  return reserved;
}

DeviceBytes held_charges(const Entry& e) { return weights::totals(charge(holdings(e), e.bytes, {}, {})); }

Holdings charged(const Entry& e) {
  Holdings out = charge(holdings(e), e.bytes, e.reserved, lease_room(e));
  uint64_t kept = 0;  // the memfds connections keep for the model's updates, mapped by the daemon
  for (const auto& weak : e.kept)
    if (const auto memfd = weak.lock()) kept += memfd->held().bytes;
  if (kept) out["cpu"]["kept_memfds"] = kept;
  return out;
}

uint64_t shared_views(const std::vector<const Entry*>& entries) {
  uint64_t sum = 0;
  model::FileSpans all;
  for (const Entry* e : entries) {
    sum += e->views.bytes();
    all.add(e->views);
  }
  return sum - all.bytes();
}

uint64_t viewed_by_others(const model::FileSpans& views, const std::vector<const Entry*>& entries, const Entry* self) {
  if (views.empty()) return 0;
  model::FileSpans others;
  for (const Entry* e : entries)
    if (e != self) others.add(e->views);
  return views.overlap(others);
}

DeviceBytes freed_by_release(DeviceBytes replaced, const Entry& e, const model::FileSpans& after,
                             const std::vector<const Entry*>& entries) {
  // Pages of checkpoints only: a copy other configs share is not counted as replaced at all.
  const auto pages = [&](const model::FileSpans& views) {
    return viewed_by_others(views.named(weights::kCopySpan, false), entries, &e);
  };
  const uint64_t before = pages(e.views), now = pages(after);
  if (const auto cpu = replaced.find("cpu"); cpu != replaced.end() && before > now) {
    cpu->second -= std::min(cpu->second, before - now);
    if (cpu->second == 0) replaced.erase(cpu);
  }
  return replaced;
}

uint64_t shared_copies(const Entry& e, const std::vector<const Entry*>& entries) {
  return viewed_by_others(e.views.named(weights::kCopySpan), entries, &e);
}

model::FileSpans views_to_come(const Entry& e, bool copies) {
  if (!e.dry || e.dry->views.empty()) return {};
  const model::FileSpans& views = copies ? e.dry->views : e.dry->views.named(weights::kCopySpan, false);
  if (!e.dry->views_chosen && storage::choose_direct_io(e.dry->checkpoint_bytes, 0, storage::page_cache_room()).direct)
    return views.named(weights::kCopySpan);  // the load will read around the page cache: copies alone
  return views;
}

bool fits(const DeviceBytes& more, const DeviceBytes& used, const Budgets& budgets) {
  for (const auto& [device, bytes] : more) {
    const auto budget = budgets.find(device);
    if (budget != budgets.end() && on(used, device) + bytes > budget->second) return false;
  }
  return true;
}

DeviceBytes room_to_reserve(const DeviceBytes& expected, const DeviceBytes& have, const DeviceBytes& extra) {
  DeviceBytes need = extra;
  for (const auto& [device, bytes] : expected)
    if (const uint64_t more = bytes - std::min(bytes, on(have, device))) need[device] += more;
  return need;
}

Holder holder_on(const Entry& e, const std::string& device, bool offload_fits, uint64_t kept) {
  const bool ready = e.state == ModelState::Ready;
  const uint64_t bytes = on(held_charges(e), device);
  return {.name = e.name,
          .bytes = bytes,
          .shared = device == "cpu" ? std::min(bytes, kept) : 0,
          .reserved = on(e.reserved, device) + on(lease_room(e), device),
          .last_used = e.last_used,
          .loaded = e.runtime && e.config,
          .ready = ready,
          .offload_device = e.config ? e.config->vram.offload.device.str() : "",
          .offload_fits = ready && offload_fits,
          .pinned = e.config && e.config->residency.pinned,
          .leased = !e.leases.empty(),
          .busy = e.busy || !e.queue.empty(),
          .waiting_for_room = e.waiting_for_room};
}

}  // namespace vramd::server
