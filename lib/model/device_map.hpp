// Device maps: which device each part of a model goes to when the model is spread over several
// (GPUs, host memory, disk), planned from sizes alone as accelerate's infer_auto_device_map
// plans them. No LibTorch and no tensor data: `vramctl plan` feeds it the layers of a model
// built on the meta device.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vramd::model {

// One weight-holding leaf layer, given in module (registration) order.
struct PlanLayer {
  std::string path;               // "model.layers.3.mlp.up_proj"
  uint64_t bytes = 0;             // its parameters in the planning dtype, less those tied to another layer's
  std::vector<std::string> tied;  // the layers whose parameters it shares (lm_head: model.embed_tokens)
  // A projection of one expert of a mixture (model::Layer::routed): the expert, up to its index
  // ("model.layers.3.mlp.experts.5"), is a unit of its own, placed after its block, whose unit
  // then holds only what every token runs through (attention, norms, router, shared experts).
  bool expert = false;
};

// How many bytes of weights a device may hold. Devices are "cuda:N", "cpu" and "disk".
struct DeviceBudget {
  std::string device;
  std::optional<uint64_t> bytes;  // nullopt: no limit (disk only)
};

// "cuda:0=2GiB,cpu=8GiB" (sizes as config::parse_size reads them) into budgets in planning
// order: GPUs by index, then cpu, then disk. Throws Error starting with `option` and naming the
// bad part: an entry that is not DEVICE=SIZE, an unknown device, a device given twice, a size
// that does not parse, or no device at all.
std::vector<DeviceBudget> parse_max_memory(std::string_view text, std::string_view option = "--max-memory");

// The unit a layer belongs to, which a device map never divides: the path up to and including
// its first all-digit component ("model.layers.3": a decoder or encoder block), else the layer
// itself ("model.embed_tokens", "lm_head"); for an expert's layer, up to its last all-digit
// component ("model.layers.3.mlp.experts.5").
std::string unit_of(std::string_view path, bool expert = false);

struct PlacedUnit {
  std::string name;  // a block ("model.layers.3") or a layer's path
  std::string device;
  uint64_t bytes = 0;
};

struct DeviceUse {
  std::string device;
  std::optional<uint64_t> budget;  // nullopt: no limit
  uint64_t bytes = 0;              // of the units placed on it
  // Room held back to bring in the largest unit placed on a later device, as accelerate keeps it
  // on its main devices (the first GPU, and cpu): its size when the planner went past this device.
  uint64_t reserved = 0;
};

struct DeviceMap {
  std::vector<PlacedUnit> units;   // every unit, in layer order
  std::vector<DeviceUse> devices;  // those of max_memory in planning order, then disk when it was not given
  uint64_t reserved = 0;           // the largest of devices[].reserved

  // The device of the innermost unit holding this layer; throws Error for an unknown layer.
  const std::string& device_of(std::string_view layer) const;
};

// Places units in order on the first device with room, GPUs first, then cpu, then disk, as
// accelerate's infer_auto_device_map does with the blocks as no_split_module_classes: a
// module that does not fit whole is divided into its children, down to units; the first GPU and
// cpu keep room for the largest unit not yet placed; layers tied together go to one device.
// Experts (PlanLayer::expert) are units of their own, after their block's.
// Disk has no limit unless max_memory gives one. Throws Error starting with `option` for unknown
// or repeated devices, a missing budget and no device at all, and when a limited disk runs out;
// and for layer lists that are not a tree (repeated paths, a layer inside another, ties to
// unknown layers).
DeviceMap plan_device_map(std::span<const PlanLayer> layers, std::span<const DeviceBudget> max_memory,
                          std::string_view option = "max_memory");

// accelerate's get_balanced_memory (transformers' device_map = "balanced" and "balanced_low_0"):
// `max_memory` with every GPU but the last lowered to an even share of the model, plus room for
// the larger of its first block (with its experts) and its final modules' mean size, times 1.25,
// so that infer_auto_device_map (plan_device_map) spreads the model evenly instead of filling
// the first GPU. `low_zero` keeps the first GPU as empty as the others allow (it then holds what
// they cannot), for the work a generate() does there. One GPU, or none: the budgets as they are.
// A mixture's experts count as one final module a block, as transformers 5 holds them. Throws
// as plan_device_map does for the budgets.
std::vector<DeviceBudget> balanced_memory(std::span<const PlanLayer> layers, std::span<const DeviceBudget> max_memory,
                                          bool low_zero, std::string_view option = "max_memory");

// Consecutive blocks on one device as one row: "model.layers.0-11" (bytes summed); other units
// as they are. For printing.
struct UnitRange {
  std::string name;
  std::string device;
  uint64_t bytes = 0;
  size_t units = 0;
};
std::vector<UnitRange> collapse_units(std::span<const PlacedUnit> units);

}  // namespace vramd::model
