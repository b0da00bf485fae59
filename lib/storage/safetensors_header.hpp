// Parsing and strict validation of a safetensors header: an 8-byte little-endian length N,
// N bytes of UTF-8 JSON, then the data region that the tensors' data_offsets must tile exactly.
//
// Errors are thrown as vramd::Error with a one-line message that names the tensor or key at
// fault but not the file; callers prefix the file's path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "storage/dtype.hpp"

namespace vramd::storage {

// The reference implementation's limit on N.
inline constexpr uint64_t kMaxHeaderSize = 100'000'000;

struct TensorRecord {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data region
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t data_offset = 0;  // 8 + N: where the data region starts in the file
  std::vector<TensorRecord> tensors;  // sorted by name
  std::vector<std::pair<std::string, std::string>> metadata;  // "__metadata__", in file order
};

// Validates `json` (the N header bytes) against a data region of `data_size` bytes.
SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_size);

// Validates a whole file held in memory: length prefix, header and data region.
SafetensorsHeader parse_safetensors_file(std::span<const std::byte> file);

// Reads and validates the header of an open file of `file_size` bytes with positioned reads;
// touches no tensor data.
SafetensorsHeader read_safetensors_header(int fd, uint64_t file_size);

}  // namespace vramd::storage
