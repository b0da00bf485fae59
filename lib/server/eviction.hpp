// Which models make room for another on a device whose budget it would pass: first sleep the
// idle ones whose offload state is on another device with room for it, then unload idle ones, each pass least
// recently used first; never a pinned, leased or busy model. A pure function over byte counts
// and facts about each model: the registry gathers the facts and runs the evictions.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace vramd::server {

// One model as the planner sees it, on the device that needs room.
struct Holder {
  std::string name;
  uint64_t bytes = 0;     // of its weights on the device
  uint64_t shared = 0;    // of those, pages others hold too (views of one checkpoint): its eviction frees the rest
  uint64_t reserved = 0;  // on the device, for the job it runs now
  std::chrono::steady_clock::time_point last_used{};
  bool loaded = false;            // holds its weights under a valid config (not loading, not failed)
  bool ready = false;             // in its computation state (loaded and not ready: offloaded)
  std::string offload_device;     // where offloading puts its weights
  bool offload_fits = false;      // ready, and its offload state fits that device's budget now
  bool pinned = false;            // [residency] pinned
  bool leased = false;            // a client holds it resident
  bool busy = false;              // runs a job or has requests queued
  bool waiting_for_room = false;  // its own next job waits for room
};

// `bytes` more for `model` on `device`, whose budget is `budget`.
struct RoomRequest {
  std::string model;
  std::string device;
  uint64_t bytes = 0;
  uint64_t budget = 0;
  uint64_t shared = 0;  // bytes the holders' `bytes` count more than once (server/budget.hpp, shared_views)
};

struct Eviction {
  enum class Kind { Offload, Unload } kind;
  std::string model;
  uint64_t bytes = 0;  // it frees on the device
};

struct RoomPlan {
  std::vector<Eviction> evictions;  // in the order to run them; none when the model fits now
  std::string error;                // it cannot fit: what it needs, what can be freed and who holds the rest
};

// `holders`: every model, the one asking included (what it holds counts as used; it is never
// evicted). Ties in last use keep their order, which is also the order the error lists them in.
RoomPlan plan_room(const RoomRequest& request, const std::vector<Holder>& holders);

}  // namespace vramd::server
