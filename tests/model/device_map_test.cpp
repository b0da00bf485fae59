#include <catch2/catch.hpp>

#include <map>

#include "model/device_map.hpp"
#include "util/error.hpp"

using namespace vramd::model;

namespace {

// A small LLaMA-like model: embeddings, two blocks of two layers, a norm, a head.
std::vector<PlanLayer> small_model(bool tied_head) {
  return {
      {"model.embed", 100, {}},
      {"model.layers.0.attn", 30, {}},
      {"model.layers.0.mlp", 20, {}},
      {"model.layers.1.attn", 30, {}},
      {"model.layers.1.mlp", 20, {}},
      {"model.norm", 1, {}},
      tied_head ? PlanLayer{"lm_head", 0, {"model.embed"}} : PlanLayer{"lm_head", 100, {}},
  };
}

std::vector<DeviceBudget> budgets(std::string_view text) { return parse_max_memory(text); }

std::map<std::string, std::string> devices(const DeviceMap& map) {
  std::map<std::string, std::string> result;
  for (const auto& unit : map.units) result[unit.name] = unit.device;
  return result;
}

const DeviceUse& use(const DeviceMap& map, std::string_view device) {
  for (const auto& entry : map.devices)
    if (entry.device == device) return entry;
  throw vramd::Error("no device " + std::string(device));
}

}  // namespace

TEST_CASE("a model that fits on one GPU goes there whole in blocks") {
  const auto layers = small_model(false);
  const DeviceMap map = plan_device_map(layers, budgets("cuda:0=1GiB"));
  REQUIRE(map.units.size() == 5);
  CHECK(map.units[1].name == "model.layers.0");
  CHECK(map.units[1].bytes == 50);
  for (const auto& unit : map.units) CHECK(unit.device == "cuda:0");
  REQUIRE(map.devices.size() == 2);  // disk comes last, with no limit
  CHECK(use(map, "cuda:0").bytes == 301);
  CHECK(use(map, "cuda:0").budget == uint64_t{1} << 30);
  CHECK(use(map, "disk").budget == std::nullopt);
  CHECK(use(map, "disk").bytes == 0);
  CHECK(map.reserved == 0);  // the planner never went past cuda:0
  CHECK(map.device_of("model.layers.1.mlp") == "cuda:0");
}

TEST_CASE("units spill from the GPU to cpu and then to disk in order") {
  // cuda:0 keeps 100 bytes (the head, the largest unit left) free: embed and block 0 fill the
  // other 150. cpu keeps 100 free too: it takes block 1, and the norm and the head go to disk.
  // (accelerate 1.15 plans the same.)
  const auto layers = small_model(false);
  const DeviceMap map = plan_device_map(layers, budgets("cpu=150,cuda:0=250"));
  CHECK(devices(map) == std::map<std::string, std::string>{{"model.embed", "cuda:0"},
                                                           {"model.layers.0", "cuda:0"},
                                                           {"model.layers.1", "cpu"},
                                                           {"model.norm", "disk"},
                                                           {"lm_head", "disk"}});
  CHECK(use(map, "cuda:0").bytes == 150);
  CHECK(use(map, "cuda:0").reserved == 100);
  CHECK(use(map, "cpu").bytes == 50);
  CHECK(use(map, "cpu").reserved == 100);
  CHECK(use(map, "disk").bytes == 101);
  CHECK(map.reserved == 100);
  // With 10 bytes more, cpu takes the rest: the head was the largest unit left, so once it is
  // the one being placed no room is kept for it.
  CHECK(plan_device_map(layers, budgets("cpu=160,cuda:0=250")).device_of("lm_head") == "cpu");
}

TEST_CASE("the room for the largest unit is kept on the first GPU and cpu but not on later GPUs") {
  std::vector<PlanLayer> layers;
  for (int i = 0; i < 5; ++i) layers.push_back({"h." + std::to_string(i) + ".w", 100, {}});
  layers.push_back({"norm", 100, {}});
  const DeviceMap map = plan_device_map(layers, budgets("cuda:0=300,cuda:1=300,cpu=1000"));
  CHECK(devices(map) == std::map<std::string, std::string>{{"h.0", "cuda:0"}, {"h.1", "cuda:0"}, {"h.2", "cuda:1"},
                                                           {"h.3", "cuda:1"}, {"h.4", "cuda:1"}, {"norm", "cpu"}});
  CHECK(use(map, "cuda:0").reserved == 100);
  CHECK(use(map, "cuda:1").bytes == 300);
  CHECK(use(map, "cuda:1").reserved == 0);
}

TEST_CASE("the reserve is the largest unit still to place so a budget of exactly the model size holds it") {
  std::vector<PlanLayer> layers = {{"embed", 50, {}}};
  for (int i = 0; i < 4; ++i) layers.push_back({"h." + std::to_string(i) + ".w", 100, {}});
  layers.push_back({"norm", 10, {}});
  const DeviceMap whole = plan_device_map(layers, budgets("cuda:0=460"));
  CHECK(whole.units.back().device == "cuda:0");
  CHECK(whole.reserved == 0);
  // One byte less and the blocks are placed one by one beside 100 bytes of reserve, until the
  // last one, beside the norm's 10.
  const DeviceMap spilled = plan_device_map(layers, budgets("cuda:0=459"));
  CHECK(spilled.device_of("h.2.w") == "cuda:0");
  CHECK(spilled.device_of("h.3.w") == "disk");
  CHECK(spilled.device_of("norm") == "disk");
  CHECK(use(spilled, "cuda:0").reserved == 10);
}

TEST_CASE("tied embeddings and head are kept on one device") {
  SECTION("the head follows the embeddings while the blocks spill") {
    std::vector<PlanLayer> layers = small_model(true);
    layers[1].bytes = layers[3].bytes = 40;  // blocks of 60
    const DeviceMap map = plan_device_map(layers, budgets("cuda:0=200,cpu=1000"));
    CHECK(devices(map) == std::map<std::string, std::string>{{"model.embed", "cuda:0"},
                                                             {"model.layers.0", "cpu"},
                                                             {"model.layers.1", "cpu"},
                                                             {"model.norm", "cpu"},
                                                             {"lm_head", "cuda:0"}});
    CHECK(use(map, "cuda:0").bytes == 100);  // the shared weight counts once
  }
  SECTION("a head too large to sit beside the embeddings takes them to the next device") {
    std::vector<PlanLayer> layers = small_model(true);
    layers.back().bytes = 50;  // a bias of its own
    const DeviceMap map = plan_device_map(layers, budgets("cuda:0=190,cpu=1000"));
    CHECK(map.device_of("model.embed") == "cpu");
    CHECK(map.device_of("lm_head") == "cpu");
  }
  SECTION("ties go both ways") {
    std::vector<PlanLayer> layers = small_model(false);
    layers.back().bytes = 0;
    layers.front().tied = {"lm_head"};
    const DeviceMap map = plan_device_map(layers, budgets("cuda:0=130,cpu=1000"));
    CHECK(map.device_of("lm_head") == map.device_of("model.embed"));
  }
}

TEST_CASE("units and runs of blocks") {
  CHECK(unit_of("model.layers.3.mlp.up_proj") == "model.layers.3");
  CHECK(unit_of("transformer.h.0.attn.c_attn") == "transformer.h.0");
  CHECK(unit_of("encoder.layer.11.output.LayerNorm") == "encoder.layer.11");
  CHECK(unit_of("model.embed_tokens") == "model.embed_tokens");
  CHECK(unit_of("lm_head") == "lm_head");
  CHECK(unit_of("blocks.2") == "blocks.2");
  CHECK(unit_of("0.1.weight") == "0");

  const std::vector<PlacedUnit> units = {{"embed", "cuda:0", 5},    {"layers.0", "cuda:0", 1}, {"layers.1", "cuda:0", 2},
                                         {"layers.2", "cpu", 4},    {"layers.3", "cpu", 8},    {"layers.5", "cpu", 16},
                                         {"other.6", "cpu", 32},    {"norm", "cpu", 64}};
  const auto rows = collapse_units(units);
  REQUIRE(rows.size() == 6);
  CHECK(rows[0].name == "embed");
  CHECK(rows[1].name == "layers.0-1");
  CHECK(rows[1].bytes == 3);
  CHECK(rows[1].units == 2);
  CHECK(rows[2].name == "layers.2-3");
  CHECK(rows[2].device == "cpu");
  CHECK(rows[3].name == "layers.5");  // not consecutive
  CHECK(rows[4].name == "other.6");
  CHECK(rows[5].name == "norm");
}

TEST_CASE("max_memory reads devices and sizes into planning order") {
  const auto parsed = parse_max_memory(" cpu=8GiB, cuda:1=1.5GB,cuda:0 = 2GiB,disk=1TiB");
  REQUIRE(parsed.size() == 4);
  CHECK(parsed[0].device == "cuda:0");
  CHECK(parsed[0].bytes == uint64_t{2} << 30);
  CHECK(parsed[1].device == "cuda:1");
  CHECK(parsed[1].bytes == 1'500'000'000);
  CHECK(parsed[2].device == "cpu");
  CHECK(parsed[3].device == "disk");
  CHECK(parsed[3].bytes == uint64_t{1} << 40);
}

TEST_CASE("a bad max_memory names the option and the bad part") {
  const std::pair<const char*, const char*> cases[] = {
      {"", "--max-memory: no device given; expected DEVICE=SIZE entries such as cuda:0=2GiB,cpu=8GiB"},
      {"  ", "--max-memory: no device given; expected DEVICE=SIZE entries such as cuda:0=2GiB,cpu=8GiB"},
      {"gpu=1GiB", "--max-memory: unknown device 'gpu'; expected cuda:N, cpu or disk"},
      {"cuda=1GiB", "--max-memory: unknown device 'cuda'; expected cuda:N, cpu or disk"},
      {"cuda:x=1GiB", "--max-memory: unknown device 'cuda:x'; expected cuda:N, cpu or disk"},
      {"cuda:0=1GiB,cpu=2GiB,cuda:0=3GiB", "--max-memory: cuda:0 is given twice"},
      {"cuda:0=1GiB,cuda:00=1GiB", "--max-memory: cuda:0 is given twice (as 'cuda:0' and 'cuda:00')"},
      {"cuda:0=lots", "--max-memory: cuda:0: 'lots' is not a size; expected a number and a unit such as \"512MiB\", \"2GiB\" or \"1.5GB\""},
      {"cpu=", "--max-memory: cpu: '' is not a size; expected a number and a unit such as \"512MiB\", \"2GiB\" or \"1.5GB\""},
      {"cuda:0", "--max-memory: 'cuda:0' is not DEVICE=SIZE (such as cuda:0=2GiB)"},
      {"cuda:0=1GiB,", "--max-memory: an empty entry in 'cuda:0=1GiB,'; expected DEVICE=SIZE entries separated by commas"},
  };
  for (const auto& [text, message] : cases) {
    INFO(text);
    CHECK_THROWS_WITH(parse_max_memory(text), message);
  }
  CHECK_THROWS_WITH(parse_max_memory("cpu=1x", "[plan].max_memory"),
                    Catch::StartsWith("[plan].max_memory: cpu: '1x' is not a size"));
}

TEST_CASE("the planner checks the budgets and layers it is given") {
  const auto layers = small_model(false);
  CHECK_THROWS_WITH(plan_device_map(layers, {}),
                    "max_memory: no device given; expected DEVICE=SIZE entries such as cuda:0=2GiB,cpu=8GiB");
  const std::vector<DeviceBudget> unknown = {{"mps", 1}};
  CHECK_THROWS_WITH(plan_device_map(layers, unknown), "max_memory: unknown device 'mps'; expected cuda:N, cpu or disk");
  const std::vector<DeviceBudget> twice = {{"cpu", 1}, {"disk", std::nullopt}, {"cpu", 2}};
  CHECK_THROWS_WITH(plan_device_map(layers, twice), "max_memory: cpu is given twice");
  const std::vector<DeviceBudget> unlimited_cpu = {{"cpu", std::nullopt}};
  CHECK_THROWS_WITH(plan_device_map(layers, unlimited_cpu), "max_memory: cpu has no size; only disk may go without a limit");

  const std::vector<PlanLayer> repeated = {{"a.w", 1, {}}, {"a.w", 1, {}}};
  CHECK_THROWS_WITH(plan_device_map(repeated, budgets("cpu=1")), "layer 'a.w' is given twice");
  const std::vector<PlanLayer> nested = {{"a", 1, {}}, {"a.w", 1, {}}};
  CHECK_THROWS_WITH(plan_device_map(nested, budgets("cpu=1")), "layer 'a' holds layer 'a.w'; layers are leaves");
  const std::vector<PlanLayer> empty_part = {{"a..w", 1, {}}};
  CHECK_THROWS_WITH(plan_device_map(empty_part, budgets("cpu=1")), "layer 'a..w' has an empty path component");
  const std::vector<PlanLayer> dangling = {{"lm_head", 0, {"embed"}}};
  CHECK_THROWS_WITH(plan_device_map(dangling, budgets("cpu=1")), "layer 'lm_head' is tied to 'embed', which is not a layer");
}

TEST_CASE("a limited disk that runs out says what did not fit") {
  const auto layers = small_model(false);
  CHECK_THROWS_WITH(plan_device_map(layers, budgets("cpu=250,disk=100"), "--max-memory"),
                    "--max-memory: the model does not fit: 'lm_head' (100 B) and what follows find no room on disk "
                    "(51 B of 100 B used) nor on the devices before it; give more room, or leave disk out for no limit on it");
  CHECK(plan_device_map(layers, budgets("cpu=250,disk=151")).units.back().device == "disk");
}

namespace {

// A mixture of experts: each block holds attention and a router every token runs through, then
// two experts of 20 bytes.
std::vector<PlanLayer> moe_model(bool experts_as_units) {
  std::vector<PlanLayer> layers{{"model.embed", 10, {}}};
  for (const char* block : {"model.layers.0", "model.layers.1"}) {
    layers.push_back({std::string(block) + ".attn", 28, {}});
    layers.push_back({std::string(block) + ".moe.gate", 2, {}});
    for (const char* expert : {".moe.experts.0.w", ".moe.experts.1.w"})
      layers.push_back({std::string(block) + expert, 20, {}, experts_as_units});
  }
  layers.push_back({"model.norm", 1, {}});
  layers.push_back({"lm_head", 10, {}});
  return layers;
}

}  // namespace

TEST_CASE("experts are units of their own, after their block's") {
  const auto layers = moe_model(true);
  const DeviceMap whole = plan_device_map(layers, budgets("cuda:0=1GiB"));
  std::vector<std::string> names;
  for (const auto& unit : whole.units) names.push_back(unit.name);
  CHECK(names == std::vector<std::string>{"model.embed", "model.layers.0", "model.layers.0.moe.experts.0",
                                          "model.layers.0.moe.experts.1", "model.layers.1", "model.layers.1.moe.experts.0",
                                          "model.layers.1.moe.experts.1", "model.norm", "lm_head"});
  CHECK(whole.units[1].bytes == 30);  // attention and router: what every token runs through
  CHECK(whole.units[2].bytes == 20);
  CHECK(use(whole, "cuda:0").bytes == 161);

  // cuda:0 keeps 30 bytes free (a block's shared part, now the largest unit) and has 70 for
  // units: the embeddings, block 0 and its first expert. Whole blocks of 70 bytes would put
  // everything but the embeddings on cpu.
  const DeviceMap split = plan_device_map(layers, budgets("cuda:0=100,cpu=1GiB"));
  const auto placed = devices(split);
  CHECK(placed.at("model.embed") == "cuda:0");
  CHECK(placed.at("model.layers.0") == "cuda:0");
  CHECK(placed.at("model.layers.0.moe.experts.0") == "cuda:0");
  CHECK(placed.at("model.layers.0.moe.experts.1") == "cpu");
  CHECK(placed.at("model.layers.1") == "cpu");
  CHECK(use(split, "cuda:0").reserved == 30);
  CHECK(split.device_of("model.layers.0.moe.experts.1.w") == "cpu");
  CHECK(split.device_of("model.layers.0.moe.gate") == "cuda:0");
  CHECK(split.device_of("model.layers.0.moe.experts.0.w") == "cuda:0");

  const DeviceMap blocks = plan_device_map(moe_model(false), budgets("cuda:0=100,cpu=1GiB"));
  REQUIRE(blocks.units.size() == 5);
  CHECK(blocks.units[1].name == "model.layers.0");
  CHECK(blocks.units[1].bytes == 70);
  CHECK(devices(blocks).at("model.layers.0") == "cpu");
  CHECK(blocks.device_of("model.layers.0.moe.experts.1.w") == "cpu");
}

TEST_CASE("an expert's unit is its path up to its last index") {
  CHECK(unit_of("model.layers.3.block_sparse_moe.experts.5.w1", true) == "model.layers.3.block_sparse_moe.experts.5");
  CHECK(unit_of("model.layers.3.block_sparse_moe.experts.5.w1") == "model.layers.3");
  CHECK(unit_of("lm_head", true) == "lm_head");
}

TEST_CASE("balanced budgets give every GPU but the last an even share and room for a block") {
  // 301 bytes: a share of 150 on two GPUs; room 1.25 x the larger of the first block (50) and the
  // mean of the final modules (301 / 7 = 43): 62. The last GPU keeps its budget.
  const auto layers = small_model(false);
  const auto sizes = [](const std::vector<DeviceBudget>& b) {
    std::map<std::string, uint64_t> out;
    for (const auto& d : b) out[d.device] = d.bytes.value_or(0);
    return out;
  };
  CHECK(sizes(balanced_memory(layers, budgets("cuda:0=1000,cuda:1=1000,cpu=1000"), false)) ==
        std::map<std::string, uint64_t>{{"cuda:0", 212}, {"cuda:1", 1000}, {"cpu", 1000}});
  // Low zero: the first GPU holds what the others cannot (301 - 1000: nothing).
  CHECK(sizes(balanced_memory(layers, budgets("cuda:0=1000,cuda:1=1000,cpu=1000"), true)) ==
        std::map<std::string, uint64_t>{{"cuda:0", 0}, {"cuda:1", 1000}, {"cpu", 1000}});
  CHECK(sizes(balanced_memory(layers, budgets("cuda:0=1000,cuda:1=100,cpu=1000"), true)).at("cuda:0") == 201);
  // One GPU, or none: as given.
  CHECK(sizes(balanced_memory(layers, budgets("cuda:0=1000,cpu=1000"), true)) ==
        std::map<std::string, uint64_t>{{"cuda:0", 1000}, {"cpu", 1000}});
  CHECK(sizes(balanced_memory(layers, budgets("cpu=1000"), false)) == std::map<std::string, uint64_t>{{"cpu", 1000}});
  // Then the map spreads the blocks instead of filling the first GPU.
  const auto map = plan_device_map(layers, balanced_memory(layers, budgets("cuda:0=1000,cuda:1=1000"), false));
  CHECK(devices(map).at("model.layers.1") == "cuda:1");
  CHECK(devices(plan_device_map(layers, budgets("cuda:0=1000,cuda:1=1000"))).at("model.layers.1") == "cuda:0");
}
