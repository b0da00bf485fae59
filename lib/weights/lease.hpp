// What a lease hands a client: every weight of a loaded model as a region of shared memory and
// a place in it. On the host, regions are sealed memfds (weights/shared_region.hpp) or, for
// weights that are plain views of a checkpoint, the checkpoint file itself, read-only: the same
// page cache, nothing copied. On a GPU, regions are allocations of CUDA's virtual memory API
// (util/cuda_vmm.hpp) whose descriptors the client imports. LibTorch-free;
// weights/lease_memory.cpp builds it from a loaded model.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "model/load_report.hpp"
#include "util/cuda_vmm.hpp"
#include "util/error.hpp"
#include "weights/shared_region.hpp"

namespace vramd::model {
class Model;
}

namespace vramd::weights {

struct LoadedModel;

struct Source;

// The model cannot be leased as configured (the message says why and what to change): 409.
class NotLeasable : public Error {
 public:
  using Error::Error;
};

struct LeaseRegion {
  std::string kind;  // "memfd", "file" or "cuda"
  std::string path;  // of a file region
  uint64_t size = 0;
  UniqueFd fd;       // a duplicate, the manifest's own
};

struct LeaseTensor {
  std::string name;   // the architecture's (Hugging Face) name
  std::string dtype;  // torch's name: "bfloat16"
  std::vector<int64_t> shape, strides;  // strides in elements
  std::optional<size_t> region;  // none for a tensor with no elements
  uint64_t offset = 0;           // bytes into the region
  // A weight held as GGUF blocks (a model that rests for its clients packed): their type ("Q4_K")
  // and the values' shape. `dtype` is then uint8 and `shape` the blocks' bytes' (packed_shape).
  std::string packed;
  std::vector<int64_t> unpacked_shape;
};

using model::ManagedPlan;
using model::ManagedUnit;

struct Manifest {
  std::string device = "cpu";
  uint64_t bytes = 0;  // of the tensors, tied ones counted once
  std::vector<LeaseRegion> regions;
  std::vector<LeaseTensor> tensors;
  std::optional<ManagedPlan> plan;  // a model that rests for its clients
  uint64_t version = 0;             // of the weights handed over (server::Runtime::version)
  // The adapters its clients apply (config::clients_apply_adapters), in order; none for another
  // model, whose weights are handed over adapted.
  std::optional<std::vector<config::LoraConfig>> loras;
};

// The plan of a model that rests for its clients, from its layers, the source that fills them
// (an integer tensor computes in its own dtype) and config: of a loaded model, or of one built
// without weights (a dry run: resting bytes then as the onload state will hold them).
ManagedPlan managed_plan(const model::Model& model, const Source& source, const config::ModelConfig& config);

// The shared memory of one loaded model, kept beside it for as long as it is loaded.
// Of each weight packed into a region (LeaseMemory::share, an update's values: WeightUpdate::shared).
inline constexpr uint64_t kRegionAlignment = 64;
inline uint64_t region_aligned(uint64_t n) { return (n + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment; }

class LeaseMemory {
 public:
  // Moves every weight that is neither in a region made before nor a view of a checkpoint into
  // one new region (sealed, on the host; on `device` when that is a GPU): the model then computes
  // from it too. Describes them all. Runs where the model's jobs run (they must not overlap).
  // Throws NotLeasable for a model whose weights are streamed, partitioned or not on `device`
  // (the host or a CUDA device).
  Manifest share(weights::LoadedModel& loaded, const std::string& name, const config::Device& device);
  // A region whose pages the model's weights may now lie in (a client's memfd, SharedRegion::adopt),
  // shared as it is while any of them does.
  void adopt(const std::shared_ptr<SharedRegion>& region);
  // Whether a lease on the host has been made of the model: its updates then write their host
  // values into regions of their own (WeightUpdate::shared), which the next lease hands on.
  bool leased_on_host() const { return leased_on_host_; }

 private:
  Manifest share_cuda(weights::LoadedModel& loaded, const std::string& name, const config::Device& device);
  std::vector<std::weak_ptr<SharedRegion>> regions_;
  bool leased_on_host_ = false;
  std::vector<std::weak_ptr<cuda::VmmRegion>> cuda_regions_;
};

}  // namespace vramd::weights
