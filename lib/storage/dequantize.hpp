// GGUF's block-quantized types to float32, as llama.cpp defines them (ggml's reference
// dequantize_row_* functions): the same values bit for bit, which the `gguf` Python package's
// dequantize witnesses in tests/storage/test_gguf.py.
#pragma once

#include <cstddef>
#include <span>

#include "storage/dtype.hpp"

namespace vramd::storage {

// Unpacks `packed` (whole blocks of `dtype`) into `out`, which holds exactly their elements.
// Reads Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (Q8_1 and Q8_K are
// llama.cpp's scratch types, not found in model files). Throws Error for another type or
// sizes that disagree.
void dequantize(DType dtype, std::span<const std::byte> packed, std::span<float> out);

}  // namespace vramd::storage
