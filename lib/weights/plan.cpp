#include "weights/plan.hpp"

#include <algorithm>
#include <numeric>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::weights {

StreamPlan plan_streaming(std::span<const SlotBytes> slots, const config::ModelConfig& config,
                          const std::string& prepared_dtype, const std::string& dtype) {
  const auto& vram = config.vram;
  const uint64_t limit = vram.limit.value_or(UINT64_MAX);
  StreamPlan plan;
  plan.resident.assign(slots.size(), false);
  plan.from_disk.assign(slots.size(), false);
  auto& stats = plan.stats;
  stats.limit = vram.limit.value_or(0);
  stats.slots = slots.size();

  uint64_t largest = 0, largest_copy = 0;
  const SlotBytes* biggest = nullptr;
  for (const auto& slot : slots) {
    if (slot.host) {
      stats.host_expert_slots++;
      stats.host_experts += slot.prepared;
      continue;
    }
    stats.total += slot.prepared;
    stats.packed += slot.packed;
    largest_copy = std::max(largest_copy, slot.copy);
    if (!biggest || slot.prepared + slot.copy > largest) biggest = &slot, largest = slot.prepared + slot.copy;
  }
  const bool fits = stats.total <= limit && largest_copy <= limit - stats.total;
  if (!fits && limit < largest)
    fail(config::where(config, "vram.limit"), "vram.limit = " + format_bytes(limit) + " cannot hold the largest layer (" +
                          format_bytes(biggest->prepared) + " in " + prepared_dtype +
                          (biggest->copy ? " plus its " + format_bytes(biggest->copy) + " copy in " + dtype +
                                               " while it computes"
                                         : "") +
                          "); raise it to at least " + (biggest->copy ? format_bytes(largest) : "that"));
  const bool onload_on_disk = vram.onload.device.is_disk();
  if (!fits && vram.onload.device == vram.computation.device && !vram.onload_limit)
    fail(config::where(config, "vram.onload.device"), "vram.onload.device = " + vram.onload.device.str() + " is the computation device, so every weight would count against "
                      "vram.limit (" + format_bytes(limit) + " < " + format_bytes(stats.total) +
                      (stats.total <= limit ? " plus a " + format_bytes(largest_copy) + " computation copy" : "") +
                      "); set onload = { device = \"disk\" } or another device" +
                      (vram.offload.device == vram.computation.device ? ", and offload with it" : ""));
  stats.streaming = fits ? largest_copy : limit >= 3 * largest ? 2 * largest : largest;

  std::vector<size_t> by_size(slots.size());
  std::iota(by_size.begin(), by_size.end(), size_t{0});
  std::stable_sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) {
    return slots[a].routed != slots[b].routed ? !slots[a].routed : slots[a].prepared < slots[b].prepared;
  });
  const auto place = [&] {
    for (const size_t i : by_size) {
      if (slots[i].host || plan.resident[i] || stats.resident + slots[i].prepared > limit - stats.streaming) continue;
      plan.resident[i] = true;
      stats.resident += slots[i].prepared;
      stats.resident_slots++;
    }
  };
  place();
  // The room streaming keeps is for the slots that stream: where the largest ones stayed
  // resident (layers every token runs through placed before smaller experts), less of it is
  // kept, and what it gave back holds more resident.
  uint64_t largest_streamed = 0;
  for (size_t i = 0; i < slots.size(); ++i)
    if (!plan.resident[i] && !slots[i].host) largest_streamed = std::max(largest_streamed, slots[i].prepared + slots[i].copy);
  if (!fits && largest_streamed < largest) {
    // Resident slots take their computation copies in that room too, as they compute. Never
    // more than was kept: what is resident was placed beside that (two of the streamed ones can
    // be more than one of the largest, which a limit under three of those kept).
    const uint64_t room = limit >= 3 * largest_streamed ? 2 * largest_streamed : largest_streamed;
    stats.streaming = std::min(stats.streaming, std::max(largest_copy, room));
    place();
  }
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i].routed) stats.expert_slots++, stats.resident_expert_slots += plan.resident[i];
  const uint64_t onload_limit = onload_on_disk ? 0 : vram.onload_limit.value_or(UINT64_MAX);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (plan.resident[i] || slots[i].host) continue;
    plan.from_disk[i] = stats.disk_slots > 0 || stats.onload + slots[i].onload > onload_limit;
    if (plan.from_disk[i]) {
      stats.disk_slots++;
      stats.disk += slots[i].prepared;
    } else {
      stats.onload += slots[i].onload;
    }
  }
  return plan;
}

PartitionPlan plan_partition(const PartitionSizes& sizes, const config::ModelConfig& config) {
  PartitionPlan plan;
  const auto ranks = static_cast<uint64_t>(sizes.ranks);
  for (const uint64_t elements : sizes.elements) {
    const uint64_t slice = (elements + ranks - 1) / ranks;
    plan.slice.push_back(slice);
    plan.bytes.push_back(slice * ranks * sizes.slice_size + (sizes.copy ? elements * sizes.size : 0));
    plan.slices += slice * sizes.slice_size;
  }
  plan.resting = (sizes.slices_on_device ? plan.slices : 0) + sizes.replicated;
  for (const auto& use : sizes.uses) {
    uint64_t bytes = 0;
    for (const size_t unit : use) bytes += plan.bytes.at(unit);
    plan.largest = std::max(plan.largest, bytes);
  }
  const uint64_t limit = config.vram.limit.value_or(UINT64_MAX);
  if (plan.resting + plan.largest > limit)
    fail(config::where(config, "vram.limit"), "[vram].limit " + format_bytes(limit) + " cannot hold this rank's " + format_bytes(plan.resting) +
                          " of slices and replicated parameters plus the largest layer gathered whole (" +
                          format_bytes(plan.largest) + "); raise it to at least " +
                          format_bytes(plan.resting + plan.largest) + ", or partition across more ranks");
  return plan;
}

}  // namespace vramd::weights
