#include "storage/dtype.hpp"

#include <array>
#include <cmath>
#include <limits>
#include <utility>

namespace vramd::storage {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  unsigned bits;  // per block
  unsigned block = 1;
  std::string_view torch = {};  // LibTorch's name, for the types it has
};

// The one table of dtype names: safetensors' (GGUF's for the block types) and LibTorch's.
constexpr std::array kDTypes = {
    DTypeInfo{DType::BOOL, "BOOL", 8, 1, "bool"},
    DTypeInfo{DType::U8, "U8", 8, 1, "uint8"},
    DTypeInfo{DType::I8, "I8", 8, 1, "int8"},
    DTypeInfo{DType::U16, "U16", 16, 1, "uint16"},
    DTypeInfo{DType::I16, "I16", 16, 1, "int16"},
    DTypeInfo{DType::U32, "U32", 32, 1, "uint32"},
    DTypeInfo{DType::I32, "I32", 32, 1, "int32"},
    DTypeInfo{DType::U64, "U64", 64, 1, "uint64"},
    DTypeInfo{DType::I64, "I64", 64, 1, "int64"},
    DTypeInfo{DType::F16, "F16", 16, 1, "float16"},
    DTypeInfo{DType::BF16, "BF16", 16, 1, "bfloat16"},
    DTypeInfo{DType::F32, "F32", 32, 1, "float32"},
    DTypeInfo{DType::F64, "F64", 64, 1, "float64"},
    DTypeInfo{DType::C64, "C64", 64, 1, "complex64"},
    DTypeInfo{DType::F8_E4M3, "F8_E4M3", 8, 1, "float8_e4m3fn"},
    DTypeInfo{DType::F8_E5M2, "F8_E5M2", 8, 1, "float8_e5m2"},
    DTypeInfo{DType::F8_E8M0, "F8_E8M0", 8, 1, "float8_e8m0fnu"},
    DTypeInfo{DType::F6_E2M3, "F6_E2M3", 6},
    DTypeInfo{DType::F6_E3M2, "F6_E3M2", 6},
    DTypeInfo{DType::F4, "F4", 4},
    // llama.cpp's ggml-common.h block layouts: bytes per block times 8.
    DTypeInfo{DType::Q4_0, "Q4_0", 18 * 8, 32},   DTypeInfo{DType::Q4_1, "Q4_1", 20 * 8, 32},
    DTypeInfo{DType::Q5_0, "Q5_0", 22 * 8, 32},   DTypeInfo{DType::Q5_1, "Q5_1", 24 * 8, 32},
    DTypeInfo{DType::Q8_0, "Q8_0", 34 * 8, 32},   DTypeInfo{DType::Q8_1, "Q8_1", 36 * 8, 32},
    DTypeInfo{DType::Q2_K, "Q2_K", 84 * 8, 256},  DTypeInfo{DType::Q3_K, "Q3_K", 110 * 8, 256},
    DTypeInfo{DType::Q4_K, "Q4_K", 144 * 8, 256}, DTypeInfo{DType::Q5_K, "Q5_K", 176 * 8, 256},
    DTypeInfo{DType::Q6_K, "Q6_K", 210 * 8, 256}, DTypeInfo{DType::Q8_K, "Q8_K", 292 * 8, 256},
};

const DTypeInfo& info(DType dtype) {
  const auto& entry = kDTypes[static_cast<size_t>(dtype)];
  return entry;
}

}  // namespace

static_assert([] {
  for (size_t i = 0; i < kDTypes.size(); ++i)
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  return true;
}(), "kDTypes must be in enum order");

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& entry : kDTypes)
    if (entry.block == 1 && entry.name == name) return entry.dtype;
  return std::nullopt;
}

std::string_view dtype_name(DType dtype) { return info(dtype).name; }

std::optional<DType> parse_torch_dtype(std::string_view name) {
  for (const auto& entry : kDTypes)
    if (!entry.torch.empty() && entry.torch == name) return entry.dtype;
  return std::nullopt;
}

std::string_view torch_dtype_name(DType dtype) {
  const auto& entry = info(dtype);
  return entry.torch.empty() ? entry.name : entry.torch;
}

unsigned dtype_bits(DType dtype) { return info(dtype).bits; }

unsigned dtype_block(DType dtype) { return info(dtype).block; }

bool is_floating(DType dtype) { return dtype >= DType::F16 && dtype != DType::C64; }

uint64_t element_count(std::span<const int64_t> shape) {
  uint64_t count = 1;
  for (int64_t dim : shape) count *= static_cast<uint64_t>(dim);
  return count;
}

float half_to_float(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  const float sign = (bits & 0x8000) ? -1.0f : 1.0f;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);
  if (exponent == 31) return mantissa ? std::numeric_limits<float>::quiet_NaN() : sign * std::numeric_limits<float>::infinity();
  return sign * std::ldexp(static_cast<float>(mantissa + 1024), exponent - 25);
}

std::optional<uint64_t> dtype_bytes(DType dtype, uint64_t elements) {
  if (elements % dtype_block(dtype) != 0) return std::nullopt;
  uint64_t bits = 0;
  if (__builtin_mul_overflow(elements / dtype_block(dtype), static_cast<uint64_t>(dtype_bits(dtype)), &bits))
    return std::nullopt;
  if (bits % 8 != 0) return std::nullopt;
  return bits / 8;
}

}  // namespace vramd::storage
