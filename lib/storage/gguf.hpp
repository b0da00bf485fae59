// Parsing and strict validation of a GGUF file's header (llama.cpp's and Ollama's format,
// versions 2 and 3, little-endian): the magic "GGUF", the version, the tensor and metadata
// counts, the metadata (typed keys and values, arrays included), the tensor infos (name,
// dimensions innermost first, ggml type, offset in the data region), then the data region at the
// next multiple of general.alignment (32 unless it says otherwise).
//
// Every count, length, offset and size is checked against the file before it is used; errors
// are one-line vramd::Error messages naming the key or tensor at fault but not the file
// (callers prefix its path).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "storage/safetensors_header.hpp"  // TensorRecord

namespace vramd::storage {

// The most bytes before the data region that vramd reads: metadata holds the tokenizer (a
// vocabulary of 256k tokens with its merges is about 10 MB).
inline constexpr uint64_t kMaxGgufHeaderSize = 256ull << 20;

struct GgufHeader {
  uint32_t version = 0;
  uint64_t alignment = 32;
  uint64_t data_offset = 0;  // where the data region starts in the file
  // Tensors in PyTorch's order of dimensions (outermost first: GGUF's reversed), `begin` and
  // `end` relative to the data region; in file order.
  std::vector<TensorRecord> tensors;
  // Each key with its value as JSON text: numbers, booleans, strings and arrays of up to 64
  // elements as they are; longer arrays (a tokenizer's vocabulary) as a string that says what
  // and how many ("[49152 strings]"). In file order.
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Whether a file starting with these bytes is GGUF (the magic alone).
bool is_gguf(std::span<const std::byte> first_bytes);

// Thrown by parse_gguf when `bytes` ends before the header does but the file goes on: read
// `needed` bytes of the file (at most kMaxGgufHeaderSize, at most the file) and try again.
struct GgufNeedsMore {
  uint64_t needed;
};

// Validates the header at the start of `bytes` (the file's first bytes; all of them when
// bytes.size() == file_size) against a file of `file_size` bytes. DiskMap reads a megabyte of
// the file first, and as much more as GgufNeedsMore asks.
GgufHeader parse_gguf(std::span<const std::byte> bytes, uint64_t file_size);

}  // namespace vramd::storage
