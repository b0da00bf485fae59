// A checkpoint's tensors as the converter's expressions (convert/expr.hpp): a tensor as itself,
// GGUF's blocks as float32, and a DCP checkpoint's chunks (storage/disk_map.hpp) joined into the
// whole tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "convert/expr.hpp"
#include "storage/disk_map.hpp"

namespace vramd::convert {

// A checkpoint tensor as an expression, the slice `info.shard` of `shards`; GGUF's block types
// read as float32 (load_tensor unpacks).
ExprPtr source_of(const storage::TensorInfo& info, uint32_t shards = 1);

// Whether tensors[i] is the first of a name several files hold (not chunks: those are joined).
bool sharded_at(std::span<const storage::TensorInfo> tensors, size_t i);

// Whether the tensor is a DCP chunk after its name's first, which whole_source joins in.
bool later_chunk(const storage::TensorInfo& info);

// The tensor `info` names as a converter sees it: itself, or for a chunk of a DCP checkpoint
// (storage/disk_map.hpp) all its name's chunks joined into the whole. Throws Error when the
// chunks do not form a grid.
ExprPtr whole_source(const storage::DiskMap& map, const storage::TensorInfo& info);

}  // namespace vramd::convert
