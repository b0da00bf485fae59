// A torch.distributed.checkpoint folder's .metadata, read by vramd's restricted unpickler
// (storage/pickle_machine.hpp) with DCP's dialect: what storage/disk_map.cpp indexes a DCP folder by.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "storage/dtype.hpp"

namespace vramd::storage {

// A torch.distributed.checkpoint folder's .metadata: each tensor's global shape and dtype, and
// where each of its chunks lies. Read by the same restricted unpickler in protocol 4, allowing
// exactly the dataclasses DCP writes there (and torch's dtypes, torch.Size, its layout getter,
// the memory-format enum and a pathlib path), so a folder cannot run code.
struct DcpChunk {
  std::vector<int64_t> offsets, sizes;  // where in the whole tensor, and how large
  std::string file;                     // relative to the folder, checked to stay in it
  uint64_t offset = 0, length = 0;      // the byte range in that file (torch.save: an archive of the chunk)
};

struct DcpTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<DcpChunk> chunks;  // as listed; every one has a storage entry
};

struct DcpMetadata {
  std::vector<DcpTensor> tensors;
  uint64_t skipped = 0;  // non-tensor entries (a step, RNG state, pickled objects)
};

// Throws Error (".metadata at byte N: ...", or naming the tensor and chunk) for any other
// global or opcode, a structure that is not DCP's, a chunk outside its tensor's shape, a chunk
// without a storage entry, a storage entry naming a file outside the folder, or a transform
// (compression) vramd does not read.
DcpMetadata read_dcp_metadata(std::string_view data);

}  // namespace vramd::storage
