// The data.pkl of a torch.save checkpoint, read by a restricted unpickler that allows only
// what a state dict is made of (collections.OrderedDict, tensor and parameter rebuilds, typed
// storages), as torch.load(weights_only=True) does: a checkpoint cannot run code. Nothing here
// reads tensor data or needs LibTorch; storage/torch_pickle.hpp finds the storages in the zip.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "storage/dtype.hpp"

namespace vramd::storage {

struct PickledTensor {
  std::string name;  // nested dicts flattened with '.'
  DType dtype;
  std::vector<int64_t> shape;
  std::string storage;         // its storage's key: the zip record data/<storage>
  uint64_t storage_bytes = 0;  // the storage's size
  uint64_t begin = 0, end = 0;  // the tensor's bytes within the storage
};

struct PickledStateDict {
  std::vector<PickledTensor> tensors;
  uint64_t skipped = 0;  // entries that are not tensors (an epoch number, a learning rate)
};

// Throws Error ("data.pkl: ...", or naming the tensor) for anything but a dict of tensors, a
// tensor that is not contiguous in its storage, or one that reaches past its storage's end.
PickledStateDict read_state_dict_pickle(std::string_view data);

}  // namespace vramd::storage
