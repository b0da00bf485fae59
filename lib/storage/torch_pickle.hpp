// PyTorch checkpoints (.bin, .pt, .pth: torch.save of a state dict, zip format), indexed lazily.
//
// LibTorch's zip reader finds the records; a restricted unpickler reads data.pkl
// (storage/state_dict_pickle.hpp), so a checkpoint cannot run code. Each tensor becomes a byte
// range of its storage record: nothing is read until a tensor is asked for.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "storage/safetensors_header.hpp"

namespace vramd::storage {

struct PickleIndex {
  std::vector<TensorRecord> tensors;  // begin/end: absolute byte offsets in the file
  uint64_t skipped = 0;               // non-tensor entries (ints, strings) left out
};

// Nested dicts are flattened with '.', so {"model": {"w": ...}} serves "model.w".
// Throws Error (without the path) when the file is not such a checkpoint.
PickleIndex index_torch_pickle(const std::string& path, uint64_t file_size);

}  // namespace vramd::storage
