// The element types a checkpoint can declare, with their sizes: safetensors' types, and GGUF's
// block-quantized ones (llama.cpp's Q4_0 ... Q8_K: blocks of 32 or 256 elements that share
// scales, stored as they are and unpacked to floats before use).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace vramd::storage {

enum class DType : uint8_t {
  BOOL, U8, I8, U16, I16, U32, I32, U64, I64,
  F16, BF16, F32, F64, C64,
  F8_E4M3, F8_E5M2, F8_E8M0,
  F6_E2M3, F6_E3M2, F4,
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
};

// The safetensors spelling ("BF16"); exact and case-sensitive, as in the reference. The block
// types are not safetensors types: never parsed, named as GGUF names them ("Q4_K").
std::optional<DType> parse_dtype(std::string_view name);
std::string_view dtype_name(DType dtype);

// LibTorch's spelling, as str(torch.bfloat16) has it after "torch." ("bfloat16",
// "float8_e4m3fn"); nullopt for any other name. The types LibTorch lacks (F6_E2M3, the block
// types) are named by dtype_name().
std::optional<DType> parse_torch_dtype(std::string_view name);
std::string_view torch_dtype_name(DType dtype);

// F16, BF16, F32, F64, the float8/6/4 types and the block types.
bool is_floating(DType dtype);

// Elements per block: 32 or 256 for the block types, 1 for the rest.
unsigned dtype_block(DType dtype);

// Bits per block: per element (4 and 6 for the packed sub-byte float types, else 8 times the
// byte size) where a block is one element.
unsigned dtype_bits(DType dtype);

// The number of elements of a shape (1 for a scalar); the caller checks for overflow where the
// shape is untrusted.
uint64_t element_count(std::span<const int64_t> shape);

// An IEEE half-precision value (F16's bits) as a float, exactly.
float half_to_float(uint16_t bits);

// Bytes of `elements` elements; nullopt when the count is not a whole number of bytes (or of
// blocks).
std::optional<uint64_t> dtype_bytes(DType dtype, uint64_t elements);

}  // namespace vramd::storage
