// The data.pkl of a torch.save checkpoint, read by a restricted unpickler that allows what
// torch.load(weights_only=True) allows and nothing more (its opcodes, its globals, BUILD only on
// an OrderedDict's attributes, persistent ids only as ('storage', type, key, location, size)),
// so a checkpoint cannot run code. Every tensor is checked against its storage as it is rebuilt;
// nothing here reads tensor data or needs LibTorch; storage/torch_pickle.hpp finds the records.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "storage/dtype.hpp"

namespace vramd::storage {

// A storage key is one dtype and one size for the whole pickle.
struct PickledStorage {
  std::string key;    // its zip record is data/<key>
  DType dtype;        // of every tensor that uses it
  uint64_t bytes = 0;  // what its record must hold, exactly
};

struct PickledTensor {
  std::string name;  // nested dicts flattened with '.'
  DType dtype;
  std::vector<int64_t> shape;
  uint32_t storage = 0;         // index into PickledStateDict::storages
  uint64_t begin = 0, end = 0;  // the tensor's bytes within the storage (empty for zero elements)
  std::string unservable;       // why the tensor is not one byte range (strided); empty when it is
};

struct PickledStateDict {
  std::vector<PickledStorage> storages;
  std::vector<PickledTensor> tensors;
  uint64_t skipped = 0;  // entries that are not tensors (an epoch number, an optimizer's int-keyed state)
};

// Limits on the work one pickle may cause, each named in the error that enforces it.
inline constexpr size_t kMaxPickleStack = size_t{1} << 20;     // items on the stack
inline constexpr size_t kMaxPickleMemo = size_t{1} << 22;      // memo slots
inline constexpr size_t kMaxPickleObjects = size_t{1} << 22;   // values built plus container items
inline constexpr size_t kMaxStateDictEntries = size_t{1} << 20;  // entries once nested dicts are flattened
inline constexpr size_t kMaxStateDictNameBytes = size_t{64} << 20;
inline constexpr int kMaxStateDictDepth = 16;

// Throws Error ("data.pkl: ... at byte N ...", or naming the tensor) for anything but a dict,
// an opcode, global or call torch.load(weights_only=True) refuses or vramd does not read, text
// that is not UTF-8, a storage key declared with two types or sizes or used as two dtypes, a
// tensor that reaches past its storage, and any limit above.
// PickleRoot::Tensor reads a pickle of one tensor (a torch.save(tensor), as DCP writes each
// chunk), as the state dict {"": tensor}.
enum class PickleRoot { StateDict, Tensor };
PickledStateDict read_state_dict_pickle(std::string_view data, PickleRoot root = PickleRoot::StateDict);

}  // namespace vramd::storage
