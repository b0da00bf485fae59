#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <vector>

#include "util/error.hpp"
#include "weights/plan.hpp"

using namespace vramd;
using namespace vramd::weights;

namespace {

constexpr uint64_t KiB = 1024;

config::ModelConfig streamed(std::optional<uint64_t> limit, std::string onload = "disk") {
  config::ModelConfig config;
  config.path = "models/m.toml";
  config.vram.computation = {config::Device::named("cpu"), storage::DType::F32};
  config.vram.onload = {config::Device::named(onload), std::nullopt};
  config.vram.limit = limit;
  return config;
}

// Slots of `kib` KiB each, in the computation dtype (no copies), resting in the same size.
std::vector<SlotBytes> slots_of(std::vector<uint64_t> kib) {
  std::vector<SlotBytes> slots;
  for (const uint64_t k : kib) slots.push_back({k * KiB, 0, k * KiB});
  return slots;
}

std::string error_of(const auto& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("streaming plan keeps everything prepared when it fits") {
  const auto plan = plan_streaming(slots_of({10, 30, 20}), streamed(100 * KiB), "Float", "Float");
  CHECK(plan.resident == std::vector<bool>{true, true, true});
  CHECK(plan.from_disk == std::vector<bool>{false, false, false});
  CHECK(plan.stats.total == 60 * KiB);
  CHECK(plan.stats.resident == 60 * KiB);
  CHECK(plan.stats.resident_slots == 3);
  CHECK(plan.stats.streaming == 0);
  CHECK(plan.stats.limit == 100 * KiB);
}

TEST_CASE("streaming plan keeps room for two of the largest when the limit holds three") {
  // 140 KiB in 5 slots under 130 KiB: room for 2 x 40, then the smallest resident while they fit
  // in the 50 KiB left (10 and 20, not the 30).
  const auto plan = plan_streaming(slots_of({10, 40, 20, 40, 30}), streamed(130 * KiB), "Float", "Float");
  CHECK(plan.stats.total == 140 * KiB);
  CHECK(plan.stats.streaming == 80 * KiB);
  CHECK(plan.resident == std::vector<bool>{true, false, true, false, false});
  CHECK(plan.stats.resident == 30 * KiB);
  CHECK(plan.stats.resident_slots == 2);
  CHECK(plan.from_disk == std::vector<bool>{false, true, false, true, true});  // onload is disk
  CHECK(plan.stats.disk_slots == 3);
  CHECK(plan.stats.disk == 110 * KiB);
  CHECK(plan.stats.onload == 0);
}

TEST_CASE("streaming plan places what every token runs through before experts, then experts in layer order") {
  // Experts of 5 KiB (routed) beside layers of 10, 20, 30 and 40 KiB under 80 KiB: room for one
  // 40 (the limit is under three); the 10 and 20 first although larger than the experts, the 30
  // passed over, then the first two experts fill the 40 KiB left.
  auto slots = slots_of({10, 5, 5, 40, 5, 20, 30});
  for (const size_t routed : {1, 2, 4}) slots[routed].routed = true;
  const auto plan = plan_streaming(slots, streamed(80 * KiB), "Float", "Float");
  CHECK(plan.stats.streaming == 40 * KiB);
  CHECK(plan.resident == std::vector<bool>{true, true, true, false, false, true, false});
  CHECK(plan.stats.resident == 40 * KiB);
  CHECK((plan.stats.expert_slots == 3 && plan.stats.resident_expert_slots == 2));
}

TEST_CASE("streaming plan keeps room for the largest slots that stream, not for resident ones") {
  // A 40 KiB layer every token runs through and 14 experts of 5 KiB under 100 KiB: room for one
  // 40 first, which leaves 4 experts beside it; the 40 stayed resident, so the room shrinks to
  // two experts and 10 fit.
  auto slots = slots_of({40, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5});
  for (size_t i = 1; i < slots.size(); ++i) slots[i].routed = true;
  const auto plan = plan_streaming(slots, streamed(100 * KiB), "Float", "Float");
  CHECK(plan.stats.streaming == 10 * KiB);
  CHECK(plan.resident[0]);
  CHECK(plan.stats.resident_expert_slots == 10);
  CHECK(plan.stats.resident == 90 * KiB);
}

TEST_CASE("streaming plan keeps room for a resident slot's computation copy when the room shrinks") {
  // Resting in float8, computed in float32: a 64 KiB layer every token runs through (its copy 128
  // KiB) and 20 experts of 8 KiB (16 KiB copies) under 350 KiB. The layer stays resident and the
  // room shrinks towards two experts' 48 KiB, but its own copy needs 128 KiB there as it computes
  // (it waited for room nothing would give back).
  std::vector<SlotBytes> slots = {{64 * KiB, 128 * KiB, 64 * KiB}};
  for (int i = 0; i < 20; ++i) slots.push_back({8 * KiB, 16 * KiB, 8 * KiB, 0, true});
  const auto plan = plan_streaming(slots, streamed(350 * KiB), "Float8_e4m3fn", "Float");
  CHECK(plan.resident[0]);
  CHECK(plan.stats.streaming == 128 * KiB);
  for (size_t i = 0; i < slots.size(); ++i) {
    INFO("slot " << i);
    const uint64_t needs = plan.resident[i] ? slots[i].copy : slots[i].prepared + slots[i].copy;
    CHECK(plan.stats.resident + needs <= 350 * KiB);
  }
}

TEST_CASE("every plan leaves each slot room to compute beside what stays resident") {
  // Random slots (some with copies, some experts) under random limits: wherever the plan does not
  // refuse the limit, each slot's op fits beside the resident ones: its copy if it stays, else
  // its bytes and its copy.
  std::mt19937_64 random(20261202);
  const auto draw = [&](uint64_t below) { return std::uniform_int_distribution<uint64_t>(1, below)(random); };
  size_t planned = 0;
  for (int round = 0; round < 2000; ++round) {
    std::vector<SlotBytes> slots(draw(24));
    uint64_t total = 0;
    for (auto& slot : slots) {
      slot.prepared = draw(64) * KiB;
      slot.copy = draw(3) == 1 ? 0 : slot.prepared * draw(4);
      slot.onload = slot.prepared;
      slot.routed = draw(2) == 1;
      total += slot.prepared + slot.copy;
    }
    const uint64_t limit = draw(total);
    StreamPlan plan;
    try {
      plan = plan_streaming(slots, streamed(limit), "Float8_e4m3fn", "Float");
    } catch (const Error&) {
      continue;  // a limit below the largest layer
    }
    planned++;
    for (size_t i = 0; i < slots.size(); ++i) {
      INFO("round " << round << ", slot " << i << " of " << slots.size() << ", limit " << limit);
      const uint64_t needs = plan.resident[i] ? slots[i].copy : slots[i].prepared + slots[i].copy;
      CHECK(needs <= plan.stats.streaming);
      CHECK(plan.stats.resident + plan.stats.streaming <= limit);
    }
  }
  CHECK(planned > 500);
}

TEST_CASE("streaming plan keeps room for one of the largest under a tight limit") {
  const auto plan = plan_streaming(slots_of({10, 40, 20, 40}), streamed(70 * KiB), "Float", "Float");
  CHECK(plan.stats.streaming == 40 * KiB);
  CHECK(plan.resident == std::vector<bool>{true, false, true, false});
  CHECK(plan.stats.resident == 30 * KiB);
}

TEST_CASE("streaming plan refuses a limit below the largest layer, naming the config") {
  const auto slots = slots_of({10, 250, 20});
  CHECK(error_of([&] { plan_streaming(slots, streamed(100 * KiB), "Float", "Float"); }) ==
        "models/m.toml: vram.limit = 100.00 KiB cannot hold the largest layer (250.00 KiB in Float); raise it to at "
        "least that");
  // With a computation copy, the layer and its copy must fit together.
  const std::vector<SlotBytes> float8 = {{62 * KiB + 512, 250 * KiB, 62 * KiB + 512}};
  CHECK(error_of([&] { plan_streaming(float8, streamed(100 * KiB), "Float8_e4m3fn", "Float"); }) ==
        "models/m.toml: vram.limit = 100.00 KiB cannot hold the largest layer (62.50 KiB in Float8_e4m3fn plus its "
        "250.00 KiB copy in Float while it computes); raise it to at least 312.50 KiB");
}

TEST_CASE("streaming plan keeps room for the computation copy even when everything fits") {
  const std::vector<SlotBytes> slots = {{10 * KiB, 40 * KiB, 10 * KiB}, {20 * KiB, 80 * KiB, 20 * KiB}};
  const auto fits = plan_streaming(slots, streamed(110 * KiB), "Float8_e4m3fn", "Float");
  CHECK(fits.stats.streaming == 80 * KiB);
  CHECK(fits.resident == std::vector<bool>{true, true});
  // 10 KiB short of that: the largest streams.
  const auto tight = plan_streaming(slots, streamed(100 * KiB), "Float8_e4m3fn", "Float");
  CHECK(tight.stats.streaming == 100 * KiB);
  CHECK(tight.resident == std::vector<bool>{false, false});
}

TEST_CASE("streaming plan counts packed GGUF blocks with their unpacked copy") {
  // A Q8_0 layer of 64K elements: 68 KiB packed, unpacked into 256 KiB of float32 for its op;
  // a float32 norm beside it.
  const std::vector<SlotBytes> slots = {{68 * KiB, 256 * KiB, 68 * KiB, 68 * KiB}, {1 * KiB, 0, 1 * KiB, 0}};
  const auto plan = plan_streaming(slots, streamed(400 * KiB), "Float and packed GGUF blocks", "Float");
  CHECK(plan.stats.total == 69 * KiB);
  CHECK(plan.stats.packed == 68 * KiB);
  CHECK(plan.stats.streaming == 256 * KiB);
  CHECK(plan.resident == std::vector<bool>{true, true});
  CHECK(error_of([&] { plan_streaming(slots, streamed(300 * KiB), "Float and packed GGUF blocks", "Float"); }) ==
        "models/m.toml: vram.limit = 300.00 KiB cannot hold the largest layer (68.00 KiB in Float and packed GGUF "
        "blocks plus its 256.00 KiB copy in Float while it computes); raise it to at least 324.00 KiB");
}

TEST_CASE("streaming plan refuses onload on the computation device when the weights do not fit") {
  const auto slots = slots_of({10, 40, 20});
  CHECK_THAT(error_of([&] { plan_streaming(slots, streamed(50 * KiB, "cpu"), "Float", "Float"); }),
             Catch::StartsWith("models/m.toml: vram.onload.device = cpu is the computation device"));
  // It fits: nothing streams, so nothing rests twice.
  CHECK_NOTHROW(plan_streaming(slots, streamed(70 * KiB, "cpu"), "Float", "Float"));
  // With an onload limit, the weights past it are read from disk instead.
  auto limited = streamed(50 * KiB, "cpu");
  limited.vram.onload_limit = 30 * KiB;
  CHECK_NOTHROW(plan_streaming(slots, limited, "Float", "Float"));
}

TEST_CASE("streaming plan rests streamed layers on the onload device in layer order up to its limit") {
  auto config = streamed(45 * KiB, "cuda:1");
  config.vram.onload_limit = 50 * KiB;
  // Room to stream one 40 KiB layer, and the 5 KiB one resident. Of the streamed ones, the 40
  // rests on the onload device; 30 more would pass its 50 KiB, so that layer and every one after
  // it (even the 8) come from disk.
  const auto plan = plan_streaming(slots_of({40, 5, 30, 8}), config, "Float", "Float");
  CHECK(plan.resident == std::vector<bool>{false, true, false, false});
  CHECK(plan.from_disk == std::vector<bool>{false, false, true, true});
  CHECK(plan.stats.onload == 40 * KiB);
  CHECK(plan.stats.disk_slots == 2);
  CHECK(plan.stats.disk == 38 * KiB);
}

TEST_CASE("streaming plan counts the onload dtype, not the prepared one, against the onload limit") {
  auto config = streamed(20 * KiB, "cuda:1");
  config.vram.onload_limit = 20 * KiB;
  // Prepared in 10 KiB each, resting in 20 KiB (say float32 at rest, bfloat16 prepared).
  const std::vector<SlotBytes> slots = {{10 * KiB, 0, 20 * KiB}, {10 * KiB, 0, 20 * KiB}, {10 * KiB, 0, 20 * KiB}};
  // Room to stream 10 KiB leaves 10 KiB: the first slot resident; 20 KiB of the second rest on
  // the onload device, and the third's 20 more would pass its limit.
  const auto plan = plan_streaming(slots, config, "BFloat16", "BFloat16");
  CHECK(plan.resident == std::vector<bool>{true, false, false});
  CHECK(plan.stats.onload == 20 * KiB);
  CHECK(plan.from_disk == std::vector<bool>{false, false, true});
}

TEST_CASE("partition plan pads each layer to the ranks and counts what rests on the device") {
  config::ModelConfig config = streamed(std::nullopt);
  PartitionSizes sizes;
  sizes.elements = {10, 8, 100};
  sizes.uses = {{0}, {1, 0}, {2}};  // the second op also uses the first layer's tied weight
  sizes.ranks = 4;
  sizes.slice_size = 2;  // bfloat16 slices
  sizes.size = 4;        // float32 computation
  sizes.copy = true;
  sizes.replicated = 64;
  sizes.slices_on_device = false;
  auto plan = plan_partition(sizes, config);
  CHECK(plan.slice == std::vector<uint64_t>{3, 2, 25});       // ceil(S / 4)
  CHECK(plan.bytes == std::vector<uint64_t>{12 * 2 + 10 * 4, 8 * 2 + 8 * 4, 100 * 2 + 100 * 4});
  CHECK(plan.slices == (3 + 2 + 25) * 2);
  CHECK(plan.resting == 64);  // the slices rest elsewhere
  CHECK(plan.largest == 600);  // the third op; the second gathers 48 + 64 = 112
  sizes.slices_on_device = true;
  sizes.copy = false;
  sizes.size = 2;
  plan = plan_partition(sizes, config);
  CHECK(plan.bytes == std::vector<uint64_t>{24, 16, 200});
  CHECK(plan.resting == 64 + 60);
  CHECK(plan.largest == 200);
}

TEST_CASE("partition plan refuses a limit that cannot hold the slices and the largest gather") {
  PartitionSizes sizes;
  sizes.elements = {1024};
  sizes.uses = {{0}};
  sizes.ranks = 2;
  sizes.slice_size = sizes.size = 4;
  sizes.slices_on_device = true;
  // 2 KiB of slices at rest plus 4 KiB gathered: 6 KiB needed.
  CHECK_NOTHROW(plan_partition(sizes, streamed(6 * KiB)));
  CHECK(error_of([&] { plan_partition(sizes, streamed(6 * KiB - 1)); }) ==
        "models/m.toml: [vram].limit 6.00 KiB cannot hold this rank's 2.00 KiB of slices and replicated parameters "
        "plus the largest layer gathered whole (4.00 KiB); raise it to at least 6.00 KiB, or partition across more "
        "ranks");
}
