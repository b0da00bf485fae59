// Where a loaded model's weights come from: the checkpoint index and, for each parameter, the
// converter's expression that fills it. Kept after loading, so that weights released to disk
// can be read again. Made by the loader, read by the kinds of weights (weights/weights.hpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "config/model_config.hpp"
#include "convert/expr.hpp"
#include "model/layer.hpp"
#include "storage/disk_map.hpp"

namespace vramd::storage {
class DeviceStaging;
}

namespace vramd::weights {

// What LoRA adapters add to a weight read from the checkpoint (fused: model::LoraTerms::fused).
using Patch = model::LoraTerms;

// Which expression fills which parameter.
struct Assignment {
  model::Parameter* parameter;
  convert::ExprPtr expr;
  uint64_t order;  // where its first source lies in the checkpoint, to read in file order
  // The GGUF block type its value can be held in, packed (convert::packed_type); set by
  // make_source. None for any other value.
  std::optional<storage::DType> block = std::nullopt;
  // Its adapters' terms, where [[lora]] changes it; such a weight is never held packed.
  std::shared_ptr<const Patch> patch = nullptr;
};

// A weight held packed is a uint8 tensor of its GGUF blocks' bytes, shaped storage::packed_shape;
// parameters are floating-point, so uint8 means packed wherever weights are held.
inline constexpr c10::ScalarType kPacked = c10::kByte;

// Whether architecture "weights" holds a checkpoint tensor of `dtype` as it is, in every state:
// integers and booleans (a BatchNorm's num_batches_tracked, a table of positions), which no state's
// dtype may cast. Not uint8, which means packed blocks wherever weights are held.
bool held_as_is(storage::DType dtype);

// The dtype a weight is held in by a state of `dtype` that keeps GGUF blocks `packed`: kPacked
// where its value can stay packed, its own where it is held as it is, else `dtype`.
c10::ScalarType held_dtype(const Assignment& assignment, c10::ScalarType dtype, bool packed);
// Its bytes so held.
uint64_t held_bytes(const Assignment& assignment, c10::ScalarType held);
// Its shape so held.
std::vector<int64_t> held_shape(const Assignment& assignment, c10::ScalarType held);

struct Source {
  storage::DiskMap map;
  std::vector<Assignment> assignments;
  std::string where;  // the config, for errors
  bool direct = false;  // reads bypass the page cache (O_DIRECT) where the file system allows it
  std::string direct_why;  // which path reads take and why, for the plan (storage::DirectChoice)

  // One parameter's value, read with positioned reads into fresh memory (or, when `views`, as
  // a view of the file mapping where dtype and alignment allow), in `dtype` (kPacked: its
  // packed bytes, for an assignment with a block type) on `device`. Reads that are not views go
  // around the page cache when `direct`.
  at::Tensor read(const Assignment& assignment, c10::Device device, c10::ScalarType dtype, bool views) const;
  // The same into `out` (contiguous, on the CPU, as held_shape says, any dtype): a positioned
  // read straight into it when the checkpoint already holds that dtype.
  void read_into(const Assignment& assignment, at::Tensor& out) const;
  // Several parameters at once into their `outs`, as read_into, the plain stored ones with
  // their reads in flight together: straight into outs on the CPU (storage::read_ranges), through
  // `staging` onto outs on its device (storage::DeviceStaging: their copies are queued on the
  // calling thread's current stream). Outs not on the CPU need `staging`.
  void read_into(std::span<const Assignment* const> assignments, std::span<at::Tensor> outs,
                 storage::DeviceStaging* staging = nullptr) const;
  // The checkpoint tensor that fills the parameter as it is stored, when the expression is a
  // plain source held in `dtype` (kPacked for a block type; its shape is the parameter's,
  // checked at load); else null.
  const storage::TensorInfo* stored(const Assignment& assignment, c10::ScalarType dtype) const;

  // `value`, the parameter held in one state, as another state holds it: in `dtype` on
  // `device`. Packed bytes are unpacked on `device` (storage/dequantize_ops.hpp); unpacked
  // values are never packed again, so packed bytes wanted from them are read from the checkpoint.
  at::Tensor convert(const Assignment& assignment, const at::Tensor& value, c10::Device device,
                     c10::ScalarType dtype) const;
  // The same into `out` (held_shape of its dtype, contiguous).
  void convert_into(const Assignment& assignment, const at::Tensor& value, at::Tensor& out) const;
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
// Its mapping has a page more than the tensor needs, so refit_buffer can place a tensor at any
// phase in it.
at::Tensor fresh_buffer(c10::IntArrayRef shape, c10::ScalarType dtype, c10::Device device, uint64_t phase = 0);

// A CPU buffer of fresh_buffer's made into one for `shape` and `dtype` beginning `phase` bytes
// into a page, where nothing else holds it: its mapping resized, or moved, by mremap, so that the
// pages both sizes need stay as they are instead of being unmapped and then faulted in again,
// each zeroed by the kernel (on a machine with few cores, the time the prefetch thread spends
// on that is taken from the op's threads). Anything else: a fresh_buffer, and `spare` freed.
at::Tensor refit_buffer(at::Tensor spare, c10::IntArrayRef shape, c10::ScalarType dtype, uint64_t phase);

// fresh_buffer's `phase` for a tensor read as `dtype` from file offset `offset` with O_DIRECT:
// the offset modulo 4096, or 0 where a buffer beginning there would not hold whole elements
// aligned to their size (the read then goes through a bounce buffer instead).
uint64_t direct_phase(uint64_t offset, c10::ScalarType dtype);

// Waits for the copies queued on the calling thread's current stream of `device` (read_into's
// through staging among them); nothing to wait for on the CPU.
void synchronise(c10::Device device);

// Writes each value into its target (target, value), a tensor of the value's shape, as copy_
// does, and returns once every write is done. A value in host memory crosses to a contiguous
// target on a GPU through pinned staging buffers (storage::DeviceStaging::copy), cast on the
// CPU first where the dtypes differ: an update's values are views of a memfd's or a
// checkpoint's mapping, which the device copies several times slower than pinned memory
// (docs/benchmarks.md, issue #48). A value already page-locked, in its target's dtype (a kept
// memfd's, server::KeptMemfd), is copied by the device directly.
void write_values(std::span<const std::pair<at::Tensor, at::Tensor>> writes);

// A device of the config as LibTorch names it; disk has no such device (an Error).
c10::Device torch_device(const config::Device& device);

// A state's dtype; "auto": `otherwise`.
c10::ScalarType state_dtype(const config::Dtype& dtype, c10::ScalarType otherwise);

// Whether `state` of a model loaded with `config` keeps GGUF blocks packed: as its `packed`
// says, or ("auto") when the model streams under [vram].limit; never on disk, nor for a
// partitioned model, whose slices would cut blocks apart.
bool packed_state(const config::DeviceState& state, const config::ModelConfig& config);

// Throws Error naming config.path and the [vram] key when a state asks for packed weights
// (packed = true) and none of `source`'s can stay packed: a switch that would do nothing.
void check_packed(const Source& source, const config::ModelConfig& config);

}  // namespace vramd::weights
