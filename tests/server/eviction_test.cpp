#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "server/eviction.hpp"

using namespace vramd::server;

namespace {

constexpr uint64_t MiB = 1 << 20;

// An idle model holding `mib` MiB on cuda:0, last used `minute` minutes into the day, that
// offloads to the CPU.
Holder idle(std::string name, uint64_t mib, int minute) {
  Holder h;
  h.name = std::move(name);
  h.bytes = mib * MiB;
  h.last_used = std::chrono::steady_clock::time_point(std::chrono::minutes(minute));
  h.loaded = h.ready = true;
  h.offload_device = "cpu";
  h.offload_fits = true;
  return h;
}

RoomRequest ask(uint64_t mib, uint64_t budget_mib) { return {"new", "cuda:0", mib * MiB, budget_mib * MiB}; }

// "offload a", "unload b": the evictions in order.
std::vector<std::string> steps(const RoomPlan& plan) {
  std::vector<std::string> out;
  for (const auto& e : plan.evictions)
    out.push_back((e.kind == Eviction::Kind::Offload ? "offload " : "unload ") + e.model);
  return out;
}

}  // namespace

TEST_CASE("eviction plans nothing when the model fits beside the others") {
  const auto plan = plan_room(ask(40, 100), {idle("a", 30, 1), idle("b", 30, 2)});
  CHECK(plan.evictions.empty());
  CHECK(plan.error.empty());
}

TEST_CASE("eviction refuses a model larger than the whole budget") {
  const auto plan = plan_room(ask(101, 100), {});
  CHECK(plan.evictions.empty());
  CHECK(plan.error ==
        "model 'new' needs 101.00 MiB on cuda:0, more than the daemon's whole budget for it (100.00 MiB)");
}

TEST_CASE("eviction prints sizes it compares precisely enough to differ") {
  // A 1025 MiB reservation against a 1024 MiB budget: "1.00 GiB" both, unless the bytes are said.
  CHECK(plan_room(ask(1025, 1024), {}).error ==
        "model 'new' needs 1.00 GiB (1074790400 bytes) on cuda:0, more than the daemon's whole budget for it "
        "(1.00 GiB (1073741824 bytes))");
  auto pinned = idle("a", 2, 1);
  pinned.pinned = true;
  CHECK(plan_room(ask(1025, 1026), {pinned}).error ==
        "model 'new' needs 1.00 GiB (1074790400 bytes) on cuda:0 but only 1.00 GiB (1073741824 bytes) of its budget of "
        "1.00 GiB can be freed; in use: a 2.00 MiB (pinned)");
}

TEST_CASE("eviction offloads models that sleep elsewhere before unloading any") {
  auto same_device = idle("a", 30, 1);  // least recently used, but its offload state is on cuda:0
  same_device.offload_device = "cuda:0";
  const auto plan = plan_room(ask(50, 100), {same_device, idle("b", 30, 3), idle("c", 30, 2)});
  CHECK(plan.error.empty());
  CHECK(steps(plan) == std::vector<std::string>{"offload c", "offload b"});
  CHECK(plan.evictions[0].bytes == 30 * MiB);
}

TEST_CASE("eviction unloads a model whose offload state would not fit where it sleeps") {
  auto no_room = idle("a", 30, 1);  // offloading it would pass the CPU's budget
  no_room.offload_fits = false;
  CHECK(steps(plan_room(ask(80, 100), {no_room, idle("b", 30, 2)})) == std::vector<std::string>{"offload b", "unload a"});
}

TEST_CASE("eviction unloads least recently used first and stops once there is room") {
  std::vector<Holder> holders = {idle("a", 30, 3), idle("b", 30, 1), idle("c", 30, 2)};
  for (auto& h : holders) h.offload_device = "cuda:0";
  CHECK(steps(plan_room(ask(40, 100), holders)) == std::vector<std::string>{"unload b"});
  CHECK(steps(plan_room(ask(60, 100), holders)) == std::vector<std::string>{"unload b", "unload c"});
}

TEST_CASE("eviction unloads an offloaded model that still holds bytes on the device") {
  auto asleep = idle("a", 30, 1);
  asleep.ready = false;
  CHECK(steps(plan_room(ask(80, 100), {asleep})) == std::vector<std::string>{"unload a"});
}

TEST_CASE("eviction offloads then unloads when offloading alone frees too little") {
  auto stays = idle("a", 40, 1);
  stays.offload_device = "cuda:0";
  CHECK(steps(plan_room(ask(90, 100), {stays, idle("b", 40, 2)})) == std::vector<std::string>{"offload b", "unload a"});
}

TEST_CASE("eviction counts reserved bytes and the asking model's own as used") {
  auto own = idle("new", 30, 0);
  auto loading = idle("b", 0, 2);
  loading.reserved = 30 * MiB;
  loading.loaded = false;
  loading.busy = true;
  const auto plan = plan_room(ask(35, 100), {own, loading, idle("c", 10, 3)});
  CHECK(steps(plan) == std::vector<std::string>{"offload c"});
}

TEST_CASE("eviction never takes pinned leased busy waiting or unloaded models") {
  auto pinned = idle("pinned", 10, 1);
  pinned.pinned = true;
  auto leased = idle("leased", 10, 1);
  leased.leased = true;
  auto busy = idle("busy", 10, 1);
  busy.busy = true;
  auto waiting = idle("waiting", 10, 1);
  waiting.waiting_for_room = true;
  auto unloaded = idle("unloaded", 10, 1);
  unloaded.loaded = unloaded.ready = false;
  const auto plan = plan_room(ask(70, 100), {busy, leased, idle("old", 10, 5), pinned, unloaded, waiting});
  CHECK(plan.evictions.empty());
  CHECK(plan.error ==
        "model 'new' needs 70.00 MiB on cuda:0 but only 50.00 MiB of its budget of 100.00 MiB can be freed; in use: "
        "busy 10.00 MiB (busy), leased 10.00 MiB (leased), old 10.00 MiB (idle), pinned 10.00 MiB (pinned), "
        "unloaded 10.00 MiB (idle), waiting 10.00 MiB (idle)");
}

TEST_CASE("eviction names nothing else when the asking model holds the rest itself") {
  const auto plan = plan_room(ask(60, 100), {idle("new", 50, 1)});
  CHECK(plan.error ==
        "model 'new' needs 60.00 MiB on cuda:0 but only 50.00 MiB of its budget of 100.00 MiB can be freed; in use: "
        "nothing else");
}

TEST_CASE("eviction keeps the given order among models last used at the same time") {
  std::vector<Holder> holders;
  for (const char* name : {"d", "a", "c", "b"}) holders.push_back(idle(name, 30, 1));
  CHECK(steps(plan_room(ask(100, 100), holders)) ==
        std::vector<std::string>{"offload d", "offload a", "offload c", "offload b"});
}

TEST_CASE("eviction counts pages several models share once, and frees only what a model does not share") {
  // a and b view the same 60 MiB of one checkpoint in host memory, each with 10 MiB of its own:
  // 80 MiB in use of 100.
  Holder a = idle("a", 70, 1), b = idle("b", 70, 2);
  a.shared = b.shared = 60 * MiB;
  RoomRequest request{"new", "cpu", 20 * MiB, 100 * MiB, 60 * MiB};
  CHECK(plan_room(request, {a, b}).evictions.empty());
  // Unloading a frees its own 10 MiB (b still views the rest): enough for 30, not for 35.
  request.bytes = 30 * MiB;
  const RoomPlan plan = plan_room(request, {a, b});
  CHECK(steps(plan) == std::vector<std::string>{"unload a"});
  CHECK(plan.evictions[0].bytes == 10 * MiB);
  request.bytes = 35 * MiB;
  // A model all of whose bytes others view frees nothing: it is never chosen.
  Holder c = idle("c", 60, 0);
  c.shared = 60 * MiB;
  request.shared = 120 * MiB;
  CHECK(steps(plan_room(request, {a, b, c})) == std::vector<std::string>{"unload a", "unload b"});
}
