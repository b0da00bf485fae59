// Where a loaded model's weights come from: the checkpoint index and, for each parameter, the
// converter's expression that fills it. Kept after loading, so that weights released to disk
// can be read again. Made by the loader, read by the kinds of weights (weights/weights.hpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "convert/expr.hpp"
#include "model/layer.hpp"
#include "storage/disk_map.hpp"

namespace vramd::weights {

// Which expression fills which parameter.
struct Assignment {
  model::Parameter* parameter;
  convert::ExprPtr expr;
  uint64_t order;  // where its first source lies in the checkpoint, to read in file order
};

struct Source {
  storage::DiskMap map;
  std::vector<Assignment> assignments;
  std::string where;  // the config, for errors
  bool direct = false;  // reads bypass the page cache (O_DIRECT) where the file system allows it
  std::string direct_why;  // which path reads take and why, for the plan (storage::DirectChoice)

  // One parameter's value, read with positioned reads into fresh memory (or, when `views`, as
  // a view of the file mapping where dtype and alignment allow), in `dtype` on `device`.
  // Reads that are not views go around the page cache when `direct`.
  at::Tensor read(const Assignment& assignment, c10::Device device, c10::ScalarType dtype, bool views) const;
  // The same into `out` (contiguous, on the CPU, the parameter's shape, any dtype): a
  // positioned read straight into it when the checkpoint already holds that dtype.
  void read_into(const Assignment& assignment, at::Tensor& out) const;
  // Several parameters at once into their `outs`, as read_into, the plain stored ones with
  // their reads in flight together (storage::read_ranges).
  void read_into(std::span<const Assignment* const> assignments, std::span<at::Tensor> outs) const;
  // The checkpoint tensor that fills the parameter as it is stored, when the expression is a
  // plain source held in `dtype` (its shape is the parameter's, checked at load); else null.
  const storage::TensorInfo* stored(const Assignment& assignment, c10::ScalarType dtype) const;
};

// The source of a model loaded with `config`: reads take O_DIRECT or the page cache as its
// direct_io says, or (unset: "auto") as suits the checkpoint: O_DIRECT when the page cache
// cannot keep it beside the weights the model holds in host memory.
std::shared_ptr<Source> make_source(storage::DiskMap map, std::vector<Assignment> assignments,
                                    const config::ModelConfig& config);

// A buffer for weights that come and go on `device`. On the CPU it is memory mapped for it
// alone and unmapped when released: had it come from malloc, freeing it (on another thread
// than the one that filled it, or between allocations of other sizes) would leave the heap
// fragmented and host memory growing forward after forward.
// On the CPU its data begins `phase` bytes into a page: a tensor read from a file offset with
// that remainder modulo 4096 then goes straight into it with O_DIRECT (storage/reader.hpp).
at::Tensor fresh_buffer(c10::IntArrayRef shape, c10::ScalarType dtype, c10::Device device, uint64_t phase = 0);

// A device of the config as LibTorch names it; disk has no such device (an Error).
c10::Device torch_device(const config::Device& device);

// A state's dtype; "auto": `otherwise`.
c10::ScalarType state_dtype(const config::Dtype& dtype, c10::ScalarType otherwise);

}  // namespace vramd::weights
