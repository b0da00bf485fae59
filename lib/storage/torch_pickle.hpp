// PyTorch checkpoints (.bin, .pt, .pth: torch.save of a state dict, zip format), indexed lazily.
//
// storage/zip_archive.hpp checks the zip, a restricted unpickler reads data.pkl
// (storage/state_dict_pickle.hpp), so a checkpoint cannot run code, and every tensor is checked
// to lie inside its storage's record before anything is mapped. Each tensor becomes a byte
// range of its record: nothing is read until a tensor is asked for. No LibTorch.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "storage/safetensors_header.hpp"
#include "storage/state_dict_pickle.hpp"

namespace vramd::storage {

// The largest data.pkl read, stored or inflated.
inline constexpr uint64_t kMaxDataPklBytes = uint64_t{64} << 20;

struct PickleIndex {
  std::vector<TensorRecord> tensors;  // begin/end: absolute byte offsets in the file
  uint64_t skipped = 0;               // entries left out: non-tensors, int-keyed optimizer state,
                                      // strided tensors outside the prefix
};

// Indexes the checkpoint whose bytes are `file`. Nested dicts are flattened with '.', so
// {"model": {"w": ...}} serves "model.w". A tensor that is not one byte range (strided) is
// refused when its name starts with `prefix`, and counted in `skipped` otherwise. Throws Error
// (without the path; naming the record, opcode offset or limit) when the file is not such a
// checkpoint.
// PickleRoot::Tensor indexes a torch.save of one tensor (a DCP chunk) as the name "".
PickleIndex index_torch_pickle(std::string_view file, std::string_view prefix, PickleRoot root = PickleRoot::StateDict);

}  // namespace vramd::storage
