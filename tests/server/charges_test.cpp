#include <catch2/catch.hpp>

#include "server/charges.hpp"

using namespace vramd;
using namespace vramd::server;

namespace {

constexpr uint64_t MiB = 1 << 20;

// A model of 100 MiB in bfloat16 computed on cuda:0, resting on the host.
std::pair<config::ModelConfig, model::DryRun> model_on_gpu() {
  config::ModelConfig config;
  config.vram.computation.device = config.vram.preparing.device = config::Device::named("cuda:0");
  config.vram.onload.device = config.vram.offload.device = config::Device::named("cpu");
  model::DryRun dry;
  dry.dtype = "bfloat16";
  dry.report.bytes = 100 * MiB;
  return {config, dry};
}

}  // namespace

TEST_CASE("a resident model is charged its weights on the computation device") {
  const auto [config, dry] = model_on_gpu();
  CHECK(computation_charges(config, dry) == DeviceBytes{{"cuda:0", 100 * MiB}});
}

TEST_CASE("a streamed model is charged its whole limit and its onload copies") {
  auto [config, dry] = model_on_gpu();
  dry.weights.emplace();
  dry.weights->limit = 30 * MiB;
  dry.weights->total = 101 * MiB;
  dry.weights->onload = 80 * MiB;
  CHECK(computation_charges(config, dry) == DeviceBytes{{"cuda:0", 30 * MiB}, {"cpu", 80 * MiB}});
  dry.weights->total = 20 * MiB;  // a plan below its limit may still fill it (GGUF blocks unpacked)
  CHECK(computation_charges(config, dry).at("cuda:0") == 30 * MiB);
  dry.weights->total = 101 * MiB;
  config.vram.onload.device = config::Device::named("disk");  // streamed from the checkpoint: nothing on the host
  CHECK(computation_charges(config, dry) == DeviceBytes{{"cuda:0", 30 * MiB}});
  dry.weights->limit = 0;  // a preparing dtype of its own and no limit: all of it prepared
  CHECK(computation_charges(config, dry) == DeviceBytes{{"cuda:0", 101 * MiB}});
}

TEST_CASE("a model asleep is charged its weights in the offload dtype where they sleep") {
  auto [config, dry] = model_on_gpu();
  CHECK(offload_charges(config, dry) == DeviceBytes{{"cpu", 100 * MiB}});
  config.vram.offload.dtype = storage::DType::F8_E4M3;
  CHECK(offload_charges(config, dry) == DeviceBytes{{"cpu", 50 * MiB}});
  config.vram.offload.dtype = storage::DType::F32;
  CHECK(offload_charges(config, dry) == DeviceBytes{{"cpu", 200 * MiB}});
  config.vram.offload.device = config::Device::named("disk");
  CHECK(offload_charges(config, dry).empty());
}

TEST_CASE("a charge is what is held, at least the floor, plus what is reserved") {
  CHECK(charges({{"cuda:0", 10}, {"cpu", 5}}, {{"cuda:0", 30}}, {{"cpu", 7}}) == DeviceBytes{{"cuda:0", 30}, {"cpu", 12}});
  CHECK(charges({{"cuda:0", 40}}, {{"cuda:0", 30}}, {}) == DeviceBytes{{"cuda:0", 40}});  // held past the floor counts
  CHECK(charges({{"cpu", 0}}, {}, {}).empty());
}
