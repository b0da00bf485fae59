// Partitioned weights, as DeepSpeed's ZeRO-3 keeps them: every rank of a group holds 1/N of
// each layer and gathers the whole layer only while it runs.
//
// A layer's parameters (those not replicated) are flattened and concatenated, padded to a
// multiple of N, and rank r keeps elements [r*k, (r+1)*k) of that flat array, k = ceil(S/N).
// A rank reads only its slice's bytes from the checkpoint (a positioned read of exactly that
// byte range for plain tensors; through the converter's expression, narrowed to the rows it
// covers, otherwise). Parameters matching [partition].replicate are held whole by every rank.
//
// When a layer's op runs, its slices are all-gathered from every rank into one buffer on the
// computation device, counted under [vram].limit with the slices and replicated parameters
// held there, and freed when the op is done. Every rank runs the same forward, so the gathers
// happen in the same order on all of them; the order is learned on the first forward, and
// from then on the next layer's gather is started while the current layer computes, when the
// limit leaves room for both.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "weights/order.hpp"
#include "weights/weights.hpp"

namespace vramd::dist {
class Communicator;
}

namespace vramd::weights {

struct Assignment;
struct SliceReads;  // partitioned.cpp

class PartitionedWeights final : public Weights {
 public:
  // Reads this rank's slices. Throws Error naming the config when the limit cannot hold the
  // slices, the replicated parameters and the largest gathered layer.
  PartitionedWeights(model::Model& model, std::shared_ptr<Source> source, const config::ModelConfig& config,
                     std::shared_ptr<dist::Communicator> communicator);
  ~PartitionedWeights() override;
  PartitionedWeights(const PartitionedWeights&) = delete;
  PartitionedWeights& operator=(const PartitionedWeights&) = delete;

  std::vector<at::Tensor> acquire(const model::Layer& layer) override;
  void release(const model::Layer& layer) override;

  // Sleep: slices and replicated parameters to the offload state (released when it is disk).
  // Wake: back. Both return the bytes moved or read on this rank.
  uint64_t sleep() override;
  uint64_t wake() override;
  std::optional<model::VramStats> stats() const override;
  std::map<std::string, uint64_t> bytes_by_device() const override;
  void check_leasable(const std::string& model, const std::string& device) const override;
  void update(const std::string& model, const WeightUpdate& update) override;
  std::optional<std::vector<RankFigures>> each_rank(int64_t peak_rss) override;

  uint64_t slice_bytes() const { return slice_bytes_; }  // this rank's share of the partitioned parameters

 private:
  struct Unit;
  struct Use;  // what one layer's op needs
  Use& use_of(const model::Layer& layer);
  // The elements [begin, end) of the unit's flat array in this rank's slice (end may fall short
  // of begin + slice: the padding).
  std::pair<int64_t, int64_t> own_elements(const Unit& unit) const;
  // This rank's slice of the unit from the checkpoint: at once, or with its reads queued in
  // `reads` to be made with others (the slice is whole once they are flushed).
  at::Tensor read_slice(const Unit& unit, c10::ScalarType dtype) const;
  at::Tensor read_slice(const Unit& unit, c10::ScalarType dtype, SliceReads& reads) const;
  void materialise(const config::DeviceState& state, std::optional<c10::Device> home);
  uint64_t resting_bytes() const;
  void start_gather(Unit& unit);
  void finish_gather(Unit& unit);
  void prefetch_after(const Use& use);
  void drop(Unit& unit);
  uint64_t held_base() const;
  void count_held();
  std::string describe() const;

  model::Model& model_;
  std::shared_ptr<Source> source_;
  config::ModelConfig config_;
  std::shared_ptr<dist::Communicator> communicator_;
  c10::Device device_;
  c10::ScalarType dtype_;
  uint64_t limit_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<std::unique_ptr<Use>> uses_;
  struct Replicated {
    model::Parameter* parameter;
    const Assignment* part;
  };
  std::vector<Replicated> replicated_;
  LearnedOrder<Use> order_;  // learned on the first forward
  c10::ScalarType slice_dtype_;  // the onload dtype
  uint64_t slice_bytes_ = 0;
  uint64_t held_ = 0;            // gathered buffers on the computation device
  model::VramStats stats_;
};

}  // namespace vramd::weights
