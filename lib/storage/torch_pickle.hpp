// PyTorch pickle checkpoints (.bin, .pt, .pth: torch.save of a state dict), read eagerly
// through LibTorch's own unpickler. They cannot be indexed lazily; safetensors can.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "storage/safetensors_header.hpp"

namespace vramd::storage {

struct EagerCheckpoint {
  std::vector<TensorRecord> tensors;  // begin/end are offsets into data
  std::shared_ptr<std::byte[]> data;  // every tensor's bytes, each 64-byte aligned
  uint64_t size = 0;
};

// Loads the state dict in `path` (nested "state_dict"/"model" dicts are not unwrapped).
// Throws Error naming the file when it holds no dict of tensors.
EagerCheckpoint load_torch_pickle(const std::string& path);

}  // namespace vramd::storage
