// What streamed and partitioned weights (weights/weights.hpp) report, without LibTorch, for the daemon's status
// and `vramctl run --stats-json`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace vramd::model {

struct VramStats {
  uint64_t limit = 0;            // 0: none
  uint64_t total = 0;            // bytes of every slot prepared (partitioned: resting, plus the largest gather)
  uint64_t resident = 0;         // kept prepared on the computation device
  uint64_t streaming = 0;        // room kept for streaming and computation copies
  size_t slots = 0, resident_slots = 0;
  uint64_t onload = 0;           // streamed slots' bytes resting on the onload device (in its dtype);
                                 // a model that rests for its clients: all of its bytes at rest
  size_t disk_slots = 0;         // streamed slots re-read from the checkpoint
  uint64_t disk = 0;             // their bytes, prepared
  uint64_t packed = 0;           // of total, GGUF blocks held packed (unpacked before each op)
  uint64_t held = 0;             // bytes on the computation device now (all of the below)
  uint64_t staging = 0;          // of those, buffers kept for reuse by the next streamed layers
  uint64_t peak = 0;             // most bytes on the computation device at any moment
  uint64_t host_staging = 0;     // pinned host memory that reads from disk to a GPU go through
  uint64_t bytes_streamed = 0;   // brought in since load
  uint64_t bytes_mapped = 0;     // of those, mapped from the page cache instead of copied (CPU)
  uint64_t bytes_packed = 0;     // of those, GGUF blocks brought in packed
  uint64_t bytes_moved = 0;      // copied into the computation device's memory for them, in the dtype
                                 // they travelled in (a float8 onload state's, or the checkpoint's)
  size_t loads = 0;              // streamed slot loads since load
  size_t prefetched = 0;         // of those, ready before their op asked
  double wait_seconds = 0;       // time ops waited for their weights
  double read_seconds = 0;       // time spent reading and converting streamed weights
  // Routed layers (each expert's projections): how many, how many kept prepared now, and their
  // ops: found prepared (hits) or brought in for the op (misses); swaps: made
  // resident in place of a resident one routed to less often; bytes streamed for them.
  size_t expert_slots = 0, resident_expert_slots = 0;
  size_t expert_hits = 0, expert_misses = 0, expert_swaps = 0;
  uint64_t expert_bytes_streamed = 0;
  // With [vram].experts = "cpu": the expert layers computed on the CPU, their bytes in host
  // memory (beside the limit, which counts the computation device), and their ops.
  size_t host_expert_slots = 0, expert_cpu_ops = 0;
  uint64_t host_experts = 0;
  bool order_learned = false;
  std::string plan;  // one line: what is resident, what streams from where, room, limit, peak
};

// The one JSON form of these figures, for the daemon's `weights` (docs/api.md) and vramctl run's
// `vram`: `limit` is null when there is none.
void to_json(nlohmann::json& out, const VramStats& stats);

}  // namespace vramd::model
