// The element types a safetensors file can declare, with their sizes.
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
};

// The safetensors spelling ("BF16"); exact and case-sensitive, as in the reference.
std::optional<DType> parse_dtype(std::string_view name);
std::string_view dtype_name(DType dtype);

// F16, BF16, F32, F64 and the float8/6/4 types.
bool is_floating(DType dtype);

// Bits per element: 4 and 6 for the packed sub-byte float types, else 8 times the byte size.
unsigned dtype_bits(DType dtype);

// The number of elements of a shape (1 for a scalar); the caller checks for overflow where the
// shape is untrusted.
uint64_t element_count(std::span<const int64_t> shape);

// Bytes of `elements` elements; nullopt when the count is not a whole number of bytes.
std::optional<uint64_t> dtype_bytes(DType dtype, uint64_t elements);

}  // namespace vramd::storage
