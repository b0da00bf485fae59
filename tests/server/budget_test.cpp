#include <catch2/catch.hpp>

#include "server/budget.hpp"
#include "weights/copy_key.hpp"

using namespace vramd;
using namespace vramd::server;

namespace {

constexpr uint64_t MiB = 1 << 20;

// A model of 100 MiB in float32 computed on the CPU, streamed under a 30 MiB limit with 50 MiB
// of its layers resting on the CPU too.
std::pair<config::ModelConfig, model::DryRun> streamed() {
  config::ModelConfig config;
  config.name = "m";
  config.vram.computation.device = config.vram.preparing.device = config::Device::named("cpu");
  config.vram.onload.device = config.vram.offload.device = config::Device::named("cpu");
  config.vram.limit = 30 * MiB;
  model::DryRun dry;
  dry.dtype = "float32";
  dry.report.bytes = 100 * MiB;
  dry.weights.emplace();
  dry.weights->limit = 30 * MiB;
  dry.weights->onload = 50 * MiB;
  dry.weights->slots = 10;
  return {config, dry};
}

}  // namespace

TEST_CASE("a model's holdings follow its state") {
  const auto [config, dry] = streamed();
  struct Case {
    const char* what;
    bool loaded;
    ModelState state;
    DeviceBytes held;
    Holdings expected;
  };
  const Case cases[] = {
      {"unloaded: nothing", false, ModelState::Unloaded, {}, {}},
      {"loading: nothing yet (the job's room counts it)", false, ModelState::Loading, {}, {}},
      {"awake: the whole limit and every onload copy, however little is held", true, ModelState::Ready,
       {{"cpu", 1 * MiB}}, {{"cpu", {{"limit", 30 * MiB}, {"onload", 50 * MiB}}}}},
      {"asleep: what it holds where it sleeps", true, ModelState::Offloaded, {{"cpu", 40 * MiB}},
       {{"cpu", {{"offload", 40 * MiB}}}}},
      {"being unloaded: what it still holds, freeing", false, ModelState::Ready, {{"cpu", 70 * MiB}},
       {{"cpu", {{"freeing", 70 * MiB}}}}},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    CHECK(holdings_of(&config, &dry, c.loaded, c.state, c.held, std::nullopt) == c.expected);
  }
  // Once loaded, the weights' own plan is the one counted.
  model::VramStats loaded = *dry.weights;
  loaded.onload = 20 * MiB;
  CHECK(holdings_of(&config, &dry, true, ModelState::Ready, {}, loaded) ==
        Holdings{{"cpu", {{"limit", 30 * MiB}, {"onload", 20 * MiB}}}});
}

TEST_CASE("what fits is what stays within every budget, and devices without one take anything") {
  const Budgets budgets{{"cpu", 100}, {"cuda:0", 50}};
  struct Case {
    DeviceBytes more, used;
    bool fits;
  };
  const Case cases[] = {
      {{{"cpu", 40}}, {{"cpu", 60}}, true},               // to the byte
      {{{"cpu", 41}}, {{"cpu", 60}}, false},
      {{{"cpu", 10}, {"cuda:0", 51}}, {}, false},         // every device must fit
      {{{"cuda:1", 1u << 30}}, {{"cpu", 100}}, true},     // no budget for cuda:1
      {{}, {{"cpu", 500}}, true},                         // nothing more: fits even past a budget
  };
  for (const auto& c : cases) CHECK(fits(c.more, c.used, budgets) == c.fits);
}

TEST_CASE("the room a job reserves is what it will hold beyond what it counts now, and its client's") {
  struct Case {
    DeviceBytes expected, have, extra, room;
  };
  const Case cases[] = {
      {{{"cpu", 100}}, {}, {}, {{"cpu", 100}}},                            // a load
      {{{"cpu", 100}}, {{"cpu", 30}}, {}, {{"cpu", 70}}},                  // a wake, part of it counted
      {{{"cpu", 100}}, {{"cpu", 130}}, {}, {}},                            // counted already
      {{}, {}, {{"cuda:0", 64}}, {{"cuda:0", 64}}},                        // a lease holding room for its client
      {{{"cpu", 10}}, {}, {{"cpu", 5}}, {{"cpu", 15}}},                    // both on one device
  };
  for (const auto& c : cases) CHECK(room_to_reserve(c.expected, c.have, c.extra) == c.room);
}

TEST_CASE("freeing replaced values gives back none of the checkpoint pages other models view") {
  Entry a, b;
  a.name = "a";
  b.name = "b";
  a.views.add("1:2", 0, 100);  // a views the whole file, b its first 60 bytes
  a.views.add(std::string(weights::kCopySpan) + "k", 0, 50);  // and a copy shared with b
  b.views.add("1:2", 0, 60);
  b.views.add(std::string(weights::kCopySpan) + "k", 0, 50);
  const std::vector<const Entry*> entries{&a, &b};
  // An update replaced a's views of [40, 100) and the shared copy (not counted as replaced: b
  // holds it), and 7 bytes on a GPU.
  model::FileSpans after;
  after.add("1:2", 0, 40);
  const DeviceBytes replaced{{"cpu", 60}, {"cuda:0", 7}};
  CHECK(freed_by_release(replaced, a, after, entries) == DeviceBytes{{"cpu", 40}, {"cuda:0", 7}});  // [60, 100)
  // Alone, every replaced view is freed; with b viewing all of them, none.
  CHECK(freed_by_release(replaced, a, after, {&a}) == replaced);
  b.views.add("1:2", 0, 100);
  CHECK(freed_by_release(replaced, a, after, entries) == DeviceBytes{{"cuda:0", 7}});
}
