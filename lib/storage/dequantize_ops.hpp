// GGUF's block-quantized types unpacked with ATen ops, on whatever device the packed bytes are:
// how weights that rest and travel packed (docs/models.md, "GGUF weights stay packed") become
// the computation dtype right before their op, on CUDA as on the CPU. Each op rounds once, as
// storage/dequantize.hpp's C++ reference and the `gguf` package do, so in float32 the values
// are theirs bit for bit (tests/storage/dequantize_ops_test.cpp, tests/storage/test_gguf.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "storage/dtype.hpp"

namespace vramd::storage {

// A tensor of `shape` as bytes of `dtype`'s blocks, the way GGUF lays them out: the blocks run
// along the last dimension, so the shape is `shape` with its last dimension counted in bytes
// ([4096, 4096] in Q4_0: [4096, 2304]). Leading dimensions index whole rows of blocks, so a
// permutation, slice or concatenation of rows applies to the packed bytes as it would to the
// values. Throws Error when the last dimension is not whole blocks.
std::vector<int64_t> packed_shape(DType dtype, c10::IntArrayRef shape);

// Unpacks `packed` (uint8, contiguous, packed_shape(dtype, out's shape)) into `out` (contiguous,
// any floating dtype, on any device): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
// Q6_K. The values are computed in float32 on out's device and rounded once into out's dtype, a
// few thousand blocks at a time (carried there as they are from packed's device), so the scratch
// memory stays a few MiB whatever the tensor's size. Throws Error for another type or sizes
// that disagree.
void dequantize_into(DType dtype, const at::Tensor& packed, at::Tensor& out);

}  // namespace vramd::storage
