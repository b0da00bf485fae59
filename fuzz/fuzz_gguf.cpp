// libFuzzer target: any bytes given to the GGUF parser as a whole file are either accepted as a
// header whose tensors lie inside the file without overlapping, or refused with vramd::Error;
// nothing else may happen (asking for more of a file it holds whole included).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

#include "storage/gguf.hpp"
#include "util/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto header = vramd::storage::parse_gguf({reinterpret_cast<const std::byte*>(data), size}, size);
    if (header.data_offset > size || header.data_offset % header.alignment != 0) std::abort();
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    for (const auto& tensor : header.tensors) {
      if (tensor.end < tensor.begin || tensor.end > size - header.data_offset || tensor.shape.empty()) std::abort();
      if (tensor.end > tensor.begin) spans.emplace_back(tensor.begin, tensor.end);
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second) std::abort();
  } catch (const vramd::Error&) {
  } catch (const vramd::storage::GgufNeedsMore&) {
    std::abort();
  }
  return 0;
}
