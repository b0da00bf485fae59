// Layer-by-layer weight management under a byte limit (the model config's [vram] table).
//
// Every weight-holding layer is a slot. The planner keeps as many small slots resident on the
// computation device as the limit allows after leaving room to stream the two largest; the
// rest rest in their onload state (disk: re-read from the checkpoint through the converter's
// expressions, positioned reads of exactly their bytes; a device: copies held there in the
// onload dtype) and are brought to the computation device when their op runs, then released.
// A prefetch thread brings the next slots, in the order learned on the first forward, while
// the current one computes, always within the limit. The limit is kept by this class's own
// byte accounting: every byte of weights on the computation device is reserved here first.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "config/model_config.hpp"

namespace vramd::model {

class Layer;
class Model;
struct WeightSource;

struct VramStats {
  uint64_t limit = 0;
  uint64_t total = 0;            // bytes of every slot in the computation dtype
  uint64_t resident = 0;         // kept on the computation device
  uint64_t streaming = 0;        // the largest two streamed slots: room kept for them
  size_t slots = 0, resident_slots = 0;
  uint64_t held = 0;             // bytes on the computation device now (resident and prefetched)
  uint64_t peak = 0;             // most bytes on the computation device at any moment
  uint64_t bytes_streamed = 0;   // brought in since load
  size_t loads = 0;              // streamed slot loads since load
  size_t prefetched = 0;         // of those, ready before their op asked
  double wait_seconds = 0;       // time ops waited for their weights
  double read_seconds = 0;       // time spent reading and converting streamed weights
  bool order_learned = false;
};

class WeightManager {
 public:
  // Plans, then materialises the resident slots (and onload copies). Throws Error naming the
  // config when the limit cannot hold the largest slot.
  WeightManager(Model& model, std::shared_ptr<WeightSource> source, const config::ModelConfig& config);
  ~WeightManager();
  WeightManager(const WeightManager&) = delete;
  WeightManager& operator=(const WeightManager&) = delete;

  // The layer's weights on the computation device, until release(). Called by Layer only.
  std::vector<at::Tensor> acquire(const Layer& layer);
  void release(const Layer& layer);

  // Sleep: every weight released (to disk) or moved to `state`. Wake: the plan restored.
  uint64_t sleep(const config::DeviceState& state);
  uint64_t wake();

  VramStats stats() const;
  std::string describe() const;  // the plan, one line per kind of placement

 private:
  struct Slot;
  Slot& slot_of(const Layer& layer);
  std::vector<at::Tensor> read(const Slot& slot, bool to_device) const;
  void materialise_plan();
  void prefetch_after(size_t position);
  void prefetch_loop();
  bool reserve_locked(std::unique_lock<std::mutex>& lock, uint64_t bytes, const Slot* needed);

  Model& model_;
  std::shared_ptr<WeightSource> source_;
  config::ModelConfig config_;
  c10::Device device_;
  c10::ScalarType dtype_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<Slot*> order_;        // execution order (learned on the first forward)
  std::vector<Slot*> seen_;         // the first forward's order as it happens
  bool learning_ = true;
  bool onload_on_disk_ = true;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t in_use_ = 0;
  VramStats stats_;
  std::vector<Slot*> prefetch_queue_;
  bool stopping_ = false;
  std::thread prefetcher_;
};

}  // namespace vramd::model
