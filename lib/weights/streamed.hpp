// Layer-by-layer weight management: the model config's [vram] table.
//
// Every weight-holding layer is a slot, and each slot's weights are in one of four states:
// offload (where they rest while the model sleeps), onload (where streamed ones rest while it
// is awake: disk, re-read from the checkpoint through the converter's expressions with
// positioned reads of exactly their bytes, or copies on another device), preparing (on the
// computation device, ready, in the preparing dtype, e.g. float8_e4m3fn) and computation (the
// dtype the op runs in: a temporary copy while the op runs when it differs from preparing).
//
// Under a limit, the planner keeps as many small slots prepared on the computation device as
// the limit allows after leaving room to stream the largest; the rest are brought there when
// their op runs and released right after. A prefetch thread prepares the next slots, in the
// order learned on the first forward, while the current one computes, always within the
// limit. The limit is kept by this class's own byte accounting: every byte of weights on the
// computation device (prepared slots, computation copies, staging buffers kept for reuse) is
// reserved here first. Without a limit every slot stays prepared; a manager is then only
// needed when the preparing dtype differs from the computation dtype.
//
// Its code, by concern: streamed.cpp (the plan, a layer's weights for its op, sleep and wake,
// figures), streamed_room.cpp (the bytes under the limit), streamed_prefetch.cpp (layers brought
// in ahead, experts kept) and streamed_update.cpp (new values); weights/streamed_slot.hpp is one
// layer's states.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "storage/device_staging.hpp"
#include "weights/order.hpp"
#include "weights/plan.hpp"
#include "weights/weights.hpp"

namespace vramd::weights {

struct Assignment;

class StreamedWeights final : public Weights {
 public:
  // Plans, then prepares the resident slots (and onload copies). Throws Error naming the
  // config when the limit cannot hold the largest slot.
  StreamedWeights(model::Model& model, std::shared_ptr<Source> source, const config::ModelConfig& config);
  // The plan the constructor would follow, from the layers' sizes alone (nothing is read), as
  // stats() shows it before the first forward. Throws as the constructor does.
  static model::VramStats plan(const model::Model& model, const Source& source, const config::ModelConfig& config);
  ~StreamedWeights() override;
  StreamedWeights(const StreamedWeights&) = delete;
  StreamedWeights& operator=(const StreamedWeights&) = delete;

  // The layer's weights on the computation device in the computation dtype, until release().
  // Called by Layer only.
  std::vector<at::Tensor> acquire(const model::Layer& layer) override;
  void release(const model::Layer& layer) override;
  void expect(std::span<const model::Layer* const> layers) override;

  // Wake: the plan restored.
  uint64_t sleep() override;
  uint64_t wake() override;
  std::optional<model::VramStats> stats() const override;
  std::map<std::string, uint64_t> bytes_by_device() const override;
  void check_leasable(const std::string& model, const std::string& device) const override;
  void update(const std::string& model, const WeightUpdate& update) override;
  bool rereads(const model::Parameter& parameter) const override;
  bool start_trace() override;
  std::vector<VramEvent> take_trace() override;

 private:
  struct Slot;
  Slot& slot_of(const model::Layer& layer);
  void show_values(Slot& slot, bool resident) const;
  std::vector<at::Tensor> prepare(const Slot& slot, std::vector<at::Tensor> buffers) const;
  at::Tensor mapped(const Slot& slot, size_t i) const;
  uint64_t phase(const Slot& slot, size_t i) const;
  at::Tensor buffer(at::Tensor buffer, c10::IntArrayRef shape, c10::ScalarType dtype, uint64_t phase = 0) const;
  std::vector<at::Tensor> computation_copy(const Slot& slot, const std::vector<at::Tensor>& prepared,
                                           std::vector<at::Tensor> buffers) const;
  void materialise_plan();
  void prefetch_after(size_t position);
  bool queue_locked(std::unique_lock<std::mutex>& lock, Slot& slot);
  bool queue_expected_locked(std::unique_lock<std::mutex>& lock);
  bool promote_locked(Slot& slot);
  void prefetch_loop();
  bool reserve_locked(std::unique_lock<std::mutex>& lock, uint64_t bytes, const Slot* needed);
  bool claim_locked(std::unique_lock<std::mutex>& lock, const Slot& slot, bool copy, uint64_t bytes,
                    std::vector<at::Tensor>& buffers, const Slot* needed);
  void count_streamed_locked(const Slot& slot, const std::vector<at::Tensor>& tensors);
  void give_back_locked(std::vector<at::Tensor>& tensors);
  void note_locked(const Slot& slot, const char* kind);
  void evict_locked(Slot& slot);  // a Ready slot not in use: its tensors go, its next use prepares it anew
  static std::string describe(const model::VramStats& stats, const config::ModelConfig& config, c10::ScalarType prepared,
                              c10::ScalarType dtype, const std::string& direct_why);

  model::Model& model_;
  std::shared_ptr<Source> source_;
  config::ModelConfig config_;
  c10::Device device_;
  c10::ScalarType dtype_;            // computation
  c10::ScalarType prepared_dtype_;   // preparing (of the weights not held packed: Slot::forms)
  uint64_t limit_;                   // UINT64_MAX without one
  bool onload_on_disk_ = true;
  bool pool_ = false;                // keep released buffers for reuse (CPU; CUDA's allocator does that itself)
  bool onload_packed_, offload_packed_;  // those states keep GGUF blocks packed (weights/source.hpp)
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unordered_map<const model::Layer*, Slot*> by_layer_;
  LearnedOrder<Slot> order_;         // layer order until the first forward's is learned

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t in_use_ = 0;              // every byte on the computation device, spares included
  std::vector<at::Tensor> spares_;   // released buffers kept for reuse, as bytes
  model::VramStats stats_;
  std::vector<Slot*> prefetch_queue_;
  std::vector<Slot*> expected_;      // routed slots whose ops run soon, in that order
  bool updated_ = false;             // an update made the weights differ from the checkpoint
  std::optional<std::chrono::steady_clock::time_point> trace_start_;
  std::vector<VramEvent> trace_;
  bool stopping_ = false;
  std::thread prefetcher_;
  mutable std::mutex staging_mutex_;  // CUDA: the pinned host buffers that reads go through
  std::unique_ptr<storage::DeviceStaging> staging_;  // CUDA; made once, in the constructor
};

}  // namespace vramd::weights
