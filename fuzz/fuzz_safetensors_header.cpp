// libFuzzer target: any bytes given to the safetensors parser are either accepted as a header
// whose tensors tile the data region, or refused with vramd::Error; nothing else may happen.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

#include "storage/safetensors_header.hpp"
#include "util/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto header = vramd::storage::parse_safetensors_file({reinterpret_cast<const std::byte*>(data), size});
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    for (const auto& tensor : header.tensors) spans.emplace_back(tensor.begin, tensor.end);
    std::sort(spans.begin(), spans.end());
    uint64_t position = 0;
    for (const auto& [begin, end] : spans) {
      if (begin != position || end < begin) std::abort();
      position = end;
    }
    if (header.data_offset + position != size) std::abort();
  } catch (const vramd::Error&) {
  }
  return 0;
}
