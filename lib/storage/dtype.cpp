#include "storage/dtype.hpp"

#include <array>
#include <utility>

namespace vramd::storage {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  unsigned bits;
};

constexpr std::array kDTypes = {
    DTypeInfo{DType::BOOL, "BOOL", 8},       DTypeInfo{DType::U8, "U8", 8},
    DTypeInfo{DType::I8, "I8", 8},           DTypeInfo{DType::U16, "U16", 16},
    DTypeInfo{DType::I16, "I16", 16},        DTypeInfo{DType::U32, "U32", 32},
    DTypeInfo{DType::I32, "I32", 32},        DTypeInfo{DType::U64, "U64", 64},
    DTypeInfo{DType::I64, "I64", 64},        DTypeInfo{DType::F16, "F16", 16},
    DTypeInfo{DType::BF16, "BF16", 16},      DTypeInfo{DType::F32, "F32", 32},
    DTypeInfo{DType::F64, "F64", 64},        DTypeInfo{DType::C64, "C64", 64},
    DTypeInfo{DType::F8_E4M3, "F8_E4M3", 8}, DTypeInfo{DType::F8_E5M2, "F8_E5M2", 8},
    DTypeInfo{DType::F8_E8M0, "F8_E8M0", 8}, DTypeInfo{DType::F6_E2M3, "F6_E2M3", 6},
    DTypeInfo{DType::F6_E3M2, "F6_E3M2", 6}, DTypeInfo{DType::F4, "F4", 4},
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
    if (entry.name == name) return entry.dtype;
  return std::nullopt;
}

std::string_view dtype_name(DType dtype) { return info(dtype).name; }

unsigned dtype_bits(DType dtype) { return info(dtype).bits; }

bool is_floating(DType dtype) { return dtype >= DType::F16 && dtype != DType::C64; }

uint64_t element_count(std::span<const int64_t> shape) {
  uint64_t count = 1;
  for (int64_t dim : shape) count *= static_cast<uint64_t>(dim);
  return count;
}

std::optional<uint64_t> dtype_bytes(DType dtype, uint64_t elements) {
  uint64_t bits = 0;
  if (__builtin_mul_overflow(elements, static_cast<uint64_t>(dtype_bits(dtype)), &bits))
    return std::nullopt;
  if (bits % 8 != 0) return std::nullopt;
  return bits / 8;
}

}  // namespace vramd::storage
