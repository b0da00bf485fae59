// Writes safetensors files and in-memory payloads that the reference implementation reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
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

// A tensor whose bytes are asked for as it is written.
struct TensorSlot {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

// The same, asking for each tensor's bytes in file order: bytes_of(i) gives tensors[i]'s (exactly
// its shape's size, else Error), valid until the next call, so that one tensor at a time need
// be in memory.
void write_safetensors(const std::string& path, std::span<const TensorSlot> tensors, const Metadata& metadata,
                       const std::function<std::span<const std::byte>(size_t)>& bytes_of);

}  // namespace vramd::storage
