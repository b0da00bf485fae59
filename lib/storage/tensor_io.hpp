// LibTorch tensors from a DiskMap, and safetensors from LibTorch tensors. The only storage
// header that pulls in ATen: include it only where tensors are really needed.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "storage/disk_map.hpp"
#include "storage/safetensors_writer.hpp"

namespace vramd::storage {

// Throws Error for the packed sub-byte types (F4, F6_*) that LibTorch cannot hold as such.
c10::ScalarType scalar_type(DType dtype);
DType dtype_of(c10::ScalarType type);  // throws Error for types safetensors lacks
// PyTorch's name of a LibTorch type ("float32", "bfloat16"), as configs and messages spell it;
// LibTorch's own ("ComplexFloat") for the few types safetensors lacks.
std::string torch_name(c10::ScalarType type);
// The tensor's LibTorch type; throws Error naming its file and key.
c10::ScalarType scalar_type(const DiskMap& map, const TensorInfo& info);

enum class ReadMode {
  Auto,    // a zero-copy view into the file mapping when the data is aligned, else a copy
  Copy,    // positioned reads into fresh memory
  Direct,  // like Copy, bypassing the page cache (O_DIRECT) where the file system allows
};

struct ReadOptions {
  std::optional<c10::ScalarType> dtype;  // convert at read time
  ReadMode mode = ReadMode::Auto;
};

// The tensor on the CPU. Views keep the file mapping alive for as long as they live; writes
// to a view stay private to this process. GGUF's block types are read packed and unpacked to
// float32 (then options.dtype), never views; or, with options.dtype uint8, left packed: their
// bytes as stored, shaped storage::packed_shape (storage/dequantize_ops.hpp), views in Auto mode.
at::Tensor load_tensor(const DiskMap& map, const TensorInfo& info, const ReadOptions& options = {});
at::Tensor load_tensor(const DiskMap& map, std::string_view name, const ReadOptions& options = {});

// A view of the tensor's bytes, in its stored dtype (a block type's packed bytes as uint8,
// shaped storage::packed_shape), in a read-only mapping made for it alone (File::map_range):
// nothing is copied, and the mapping goes with the tensor, so nothing of the file stays mapped
// after. Writing to it faults. Undefined when the data is not aligned to its dtype or is empty.
at::Tensor map_tensor(const DiskMap& map, const TensorInfo& info);
// `bytes` as a CPU tensor of `shape` in `type`: a view of them, kept valid by `owner`, where
// they are aligned for `type`; else a copy.
at::Tensor view_or_copy(std::span<const std::byte> bytes, c10::ScalarType type, c10::IntArrayRef shape,
                        std::shared_ptr<void> owner);
// A block-typed tensor's packed bytes unpacked to float32 (storage/dequantize.hpp); throws
// Error naming its file and key.
at::Tensor unpacked(const DiskMap& map, const TensorInfo& info, std::span<const std::byte> packed);
// Whether the tensor's memory is such a mapping, never to be written.
bool is_mapped_view(const at::Tensor& tensor);

// Casts `value` into `out` (both contiguous, as many elements, any dtypes and devices) with no
// memory but out's own, the value's bytes carried into out as they are and cast there. Onto a
// device from the host, a plain copy_ casts on the host, one core at a fraction of the bus's
// speed, and carries the wider form across (a float8 onload state's layers crossed as bfloat16);
// from host to host, copy_ is faster.
void cast_into(const at::Tensor& value, at::Tensor& out);

struct LoadOptions {
  std::optional<c10::ScalarType> dtype;  // convert after reading
  bool direct = false;                   // O_DIRECT: for cold data, keeps the page cache clean
  unsigned threads = 0;                  // reads in flight; 0: storage::ReaderOptions' default
};

// Reads many tensors at once: one host allocation laid out as the files are, filled by large
// reads with several in flight (storage::read_ranges), so that neighbouring tensors cost one. Returns
// the tensors in the order given; they share the allocation, which lives while any of them
// does. The fastest way to bring a whole model into host memory.
std::vector<at::Tensor> load_tensors(const DiskMap& map, std::span<const TensorInfo* const> infos,
                                     const LoadOptions& options = {});

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Safetensors bytes of the tensors (any device or layout; copied to contiguous CPU memory).
std::string serialize_tensors(const NamedTensors& tensors, const Metadata& metadata = {});
void save_tensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata = {});

}  // namespace vramd::storage
