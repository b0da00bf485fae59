#include <catch2/catch.hpp>

#include "util/error.hpp"
#include "weights/holdings.hpp"

using namespace vramd;
using namespace vramd::weights;

namespace {

constexpr uint64_t MiB = 1 << 20;

// A model of 100 MiB in bfloat16 computed on `computation`, resting on the host.
std::pair<config::ModelConfig, model::DryRun> model_on(const char* computation = "cuda:0") {
  config::ModelConfig config;
  config.name = "m";
  config.path = "m.toml";
  config.vram.computation.device = config.vram.preparing.device = config::Device::named(computation);
  config.vram.onload.device = config.vram.offload.device = config::Device::named("cpu");
  model::DryRun dry;
  dry.dtype = "bfloat16";
  dry.report.bytes = 100 * MiB;
  return {config, dry};
}

model::VramStats streamed(uint64_t limit, uint64_t total, uint64_t onload) {
  model::VramStats stats;
  stats.limit = limit;
  stats.total = total;
  stats.onload = onload;
  stats.slots = 10;
  stats.resident_slots = 4;
  return stats;
}

}  // namespace

TEST_CASE("a resident model can hold its weights on the computation device") {
  const auto [config, dry] = model_on();
  CHECK(awake_holdings(config, dry) == Holdings{{"cuda:0", {{"weights", 100 * MiB}}}});
}

TEST_CASE("a streamed model can hold its whole limit its onload copies and its staging buffers") {
  auto [config, dry] = model_on();
  dry.weights = streamed(30 * MiB, 101 * MiB, 80 * MiB);
  CHECK(awake_holdings(config, dry) ==
        Holdings{{"cuda:0", {{"limit", 30 * MiB}}}, {"cpu", {{"onload", 80 * MiB}, {"host_staging", kHostStagingBytes}}}});
  dry.weights->total = 20 * MiB;  // a plan below its limit may still fill it (GGUF blocks unpacked)
  CHECK(awake_holdings(config, dry).at("cuda:0").at("limit") == 30 * MiB);
  dry.weights->limit = 0;  // a preparing dtype of its own and no limit: all of it prepared, and a copy's room
  dry.weights->resident = 20 * MiB;
  dry.weights->streaming = 3 * MiB;
  CHECK(awake_holdings(config, dry).at("cuda:0").at("limit") == 23 * MiB);
}

TEST_CASE("an onload tier on the computation device is counted beside the limit") {
  // The case a new user found (#66): both on the CPU, and only the limit was charged.
  auto [config, dry] = model_on("cpu");
  dry.weights = streamed(1 * MiB, 2 * MiB, 491520);
  const Holdings holdings = awake_holdings(config, dry);
  CHECK(holdings == Holdings{{"cpu", {{"limit", 1 * MiB}, {"onload", 491520}}}});  // no staging on the CPU
  CHECK(totals(holdings) == std::map<std::string, uint64_t>{{"cpu", 1 * MiB + 491520}});
}

TEST_CASE("layers streamed from disk and experts on the cpu are charged where they are") {
  auto [config, dry] = model_on();
  config.vram.onload.device = config::Device::named("disk");
  dry.weights = streamed(30 * MiB, 101 * MiB, 0);
  dry.weights->host_experts = 60 * MiB;
  dry.weights->host_expert_slots = 6;
  CHECK(awake_holdings(config, dry) ==
        Holdings{{"cuda:0", {{"limit", 30 * MiB}}}, {"cpu", {{"experts", 60 * MiB}}}});  // every streamed slot an expert
  dry.weights->host_expert_slots = 2;
  CHECK(awake_holdings(config, dry).at("cpu").at("host_staging") == kHostStagingBytes);
}

TEST_CASE("the loaded weights' plan replaces the dry run's") {
  auto [config, dry] = model_on();
  config.partition.world_size = 2;  // a partitioned model: planned when its group loads it
  CHECK(awake_holdings(config, dry) == Holdings{{"cuda:0", {{"weights", 100 * MiB}}}});
  auto loaded = streamed(40 * MiB, 40 * MiB, 50 * MiB);
  loaded.resident_slots = loaded.slots;
  CHECK(awake_holdings(config, dry, loaded) == Holdings{{"cuda:0", {{"limit", 40 * MiB}}}, {"cpu", {{"onload", 50 * MiB}}}});
}

TEST_CASE("a weights model resting for its clients is charged its resting bytes on the host") {
  auto [config, dry] = model_on();
  config.architecture = "weights";
  config.vram.limit = 10 * MiB;
  dry.weights = streamed(10 * MiB, 0, 70 * MiB);
  CHECK(awake_holdings(config, dry) == Holdings{{"cpu", {{"resting", 70 * MiB}}}});
}

TEST_CASE("a model asleep holds its weights in the offload dtype where they sleep") {
  auto [config, dry] = model_on();
  CHECK(asleep_holdings(config, dry) == Holdings{{"cpu", {{"offload", 100 * MiB}}}});
  config.vram.offload.dtype = storage::DType::F8_E4M3;
  CHECK(asleep_holdings(config, dry) == Holdings{{"cpu", {{"offload", 50 * MiB}}}});
  config.vram.offload.dtype = storage::DType::F32;
  CHECK(asleep_holdings(config, dry) == Holdings{{"cpu", {{"offload", 200 * MiB}}}});
  config.vram.offload.device = config::Device::named("disk");
  CHECK(asleep_holdings(config, dry).empty());
}

TEST_CASE("a model that can hold more than a whole budget is refused naming its key and parts") {
  auto [config, dry] = model_on("cpu");
  config.positions["vram"] = {3, 1};
  config.positions["vram.limit"] = {5, 1};
  config.vram.limit = 1 * MiB;
  dry.weights = streamed(1 * MiB, 2 * MiB, 491520);
  config::DaemonConfig daemon;
  daemon.path = "vramd.toml";
  daemon.budgets["cpu"] = 1 * MiB + 491520;
  CHECK_NOTHROW(check_budgets(config, dry, daemon));
  daemon.budgets["cpu"] -= 1;
  CHECK_THROWS_WITH(check_budgets(config, dry, daemon),
                    "m.toml:5:1: model 'm' holds up to 1.47 MiB (1540096 bytes) on cpu (limit 1.00 MiB, onload "
                    "480.00 KiB), more than the daemon's whole budget for it (1.47 MiB (1540095 bytes), vramd.toml): "
                    "it could never load; lower vram.limit, rest its layers elsewhere (onload) or raise the budget");
  daemon.budgets.erase("cpu");  // no budget: the device's own size decides
  CHECK_NOTHROW(check_budgets(config, dry, daemon));
}
