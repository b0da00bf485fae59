// libFuzzer target: any bytes given to the safetensors parser are either accepted as a header
// whose tensors tile the data region, or refused with vramd::Error; nothing else may happen.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "storage/safetensors_header.hpp"
#include "util/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto header = vramd::storage::parse_safetensors_file({reinterpret_cast<const std::byte*>(data), size});
    uint64_t position = 0;
    for (const auto& tensor : header.tensors) {
      if (tensor.begin != position || tensor.end < tensor.begin) std::abort();
      position = tensor.end;
    }
    if (header.data_offset + position != size) std::abort();
  } catch (const vramd::Error&) {
  }
  return 0;
}
