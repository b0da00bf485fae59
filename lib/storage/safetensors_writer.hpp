// Writes safetensors files and in-memory payloads that the reference implementation reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "storage/dtype.hpp"

namespace vramd::storage {

struct TensorData {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;  // exactly the shape's size, row-major
};

using Metadata = std::vector<std::pair<std::string, std::string>>;

// The length prefix and header, padded with spaces to a multiple of 8 bytes. Tensors are laid
// out largest element first (then by name), so each starts aligned to its element size.
// Throws Error when a tensor's bytes do not match its shape, or a name repeats.
std::string safetensors_header(std::span<const TensorData> tensors, const Metadata& metadata = {});

// The whole file in memory.
std::string serialize_safetensors(std::span<const TensorData> tensors, const Metadata& metadata = {});

// Writes to `path` atomically: a temporary file beside it, renamed into place when complete.
void write_safetensors(const std::string& path, std::span<const TensorData> tensors,
                       const Metadata& metadata = {});

}  // namespace vramd::storage
