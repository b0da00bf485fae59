// Residency plans from byte counts alone, LibTorch-free: which layers of streamed weights stay
// prepared on the computation device, how much room streaming keeps, which streamed layers rest
// on the onload device and which on disk; and whether partitioned weights fit their limit. The
// kinds of weights (weights/streamed.hpp, weights/partitioned.hpp) follow these plans, and
// `vramctl check` and the daemon's validation run them before anything is read.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "model/vram_stats.hpp"

namespace vramd::weights {

// One layer's weights as a streaming plan counts them.
struct SlotBytes {
  uint64_t prepared = 0;  // on the computation device in the preparing dtype
  uint64_t copy = 0;      // the computation copy while its op runs (0: preparing is computation)
  uint64_t onload = 0;    // resting on the onload device, in the onload dtype
  uint64_t packed = 0;    // of prepared, GGUF blocks held packed
  bool routed = false;    // an expert's projection (model::Layer::routed): placed after the rest
  bool host = false;      // routed and computed on the CPU ([vram].experts = "cpu"): never on the
                          // computation device; `prepared` is its bytes in host memory
};

struct StreamPlan {
  std::vector<bool> resident;   // per slot: kept prepared on the computation device
  std::vector<bool> from_disk;  // per slot: streamed and re-read from the checkpoint
  model::VramStats stats;       // limit, total, packed, slots, streaming room, resident, onload and disk figures
};

// Everything prepared when it fits with room for one computation copy; else room to stream the
// largest slots with their copies (two of them when the limit holds three, so that the next is
// read while one computes), and the smallest slots resident in what is left: first those every
// token runs through, then routed ones (experts), in layer order. Streamed slots rest
// on the onload device in layer order while [vram].onload_limit allows, from the first that does
// not fit on disk. `prepared_dtype` and `dtype` (the computation's) name the dtypes in errors.
// Throws Error naming config.path when the limit cannot hold the largest slot, or when the
// onload device is the computation device and the weights do not fit.
StreamPlan plan_streaming(std::span<const SlotBytes> slots, const config::ModelConfig& config,
                          const std::string& prepared_dtype, const std::string& dtype);

// Partitioned weights as one rank counts them: each unit is one layer's partitioned parameters
// flattened together (S elements), padded to a multiple of the ranks N, of which each rank
// keeps k = ceil(S / N); each op gathers its units whole.
struct PartitionSizes {
  std::vector<uint64_t> elements;          // S, per unit
  std::vector<std::vector<size_t>> uses;   // per op of a layer, the units it gathers
  uint64_t replicated = 0;  // bytes of the parameters every rank holds whole, on the computation device
  int ranks = 1;
  size_t slice_size = 0;    // bytes per element of the slices (the onload dtype)
  size_t size = 0;          // bytes per element of the computation dtype
  bool copy = false;        // the dtypes differ: a gathered unit is copied into the computation dtype
  bool slices_on_device = false;  // the slices rest on the computation device (onload is it)
};

struct PartitionPlan {
  std::vector<uint64_t> slice;  // k, per unit
  std::vector<uint64_t> bytes;  // per unit, gathered: N * k in the slice dtype, plus the computation copy
  uint64_t slices = 0;   // this rank's slices, in the slice dtype
  uint64_t resting = 0;  // on the computation device at rest: the slices when they rest there, and replicated
  uint64_t largest = 0;  // the most one op gathers
};

// Throws Error naming config.path when [vram].limit cannot hold the resting bytes and the
// largest gather at once.
PartitionPlan plan_partition(const PartitionSizes& sizes, const config::ModelConfig& config);

}  // namespace vramd::weights
