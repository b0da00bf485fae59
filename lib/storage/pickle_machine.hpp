// The pickle machine of torch.load(weights_only=True), for vramd's readers of pickles only
// (storage/state_dict_pickle.cpp: a torch.save checkpoint's data.pkl; storage/dcp_metadata.cpp: a
// torch.distributed.checkpoint folder's .metadata): its opcodes, and the globals each dialect
// allows, nothing more, so a pickle cannot run code. It builds Values and the storage and tensor
// tables a data.pkl names; its readers interpret them. Every limit is named in the error that
// enforces it (storage/state_dict_pickle.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "storage/dtype.hpp"

namespace vramd::storage::pickle {

enum class Kind : uint8_t { None, Bool, Int, Float, Str, Tuple, List, Dict, Global, Storage, Tensor, Object, Other };

// The globals torch.load(weights_only=True) allows that vramd reads; any other global is refused
// where it is named, and a global torch allows but vramd does not read is refused when called.
enum class Callable : uint8_t {
  OrderedDict, Counter, Parameter, Size, Device, Encode, Bytearray, Set, Complex, Layout,
  DTypeName, TypedStorage, UntypedStorage, RebuildTensor, RebuildTensorV2, RebuildTensorV3,
  RebuildParameter, RebuildParameterWithState, RebuildFromTypeV2, TensorType, Unread,
  // A DCP .metadata's: its dataclasses (built by NEWOBJ, filled by BUILD), its memory-format
  // enum and the path it records (both read as opaque values).
  DcpClass, DcpEnum, Path,
};

// What a pickle is: a torch.save checkpoint's data.pkl (protocol 2, torch.load(weights_only=True)'s
// rules), or a torch.distributed.checkpoint folder's .metadata (protocol 4, DCP's dataclasses).
enum class Dialect : uint8_t { DataPkl, DcpMetadata };

struct Value {
  Kind kind = Kind::None;
  Callable callable = Callable::Unread;  // Global
  bool ordered = false;                  // Dict: an OrderedDict, whose attributes BUILD may set
  DType dtype = DType::U8;               // Global of a dtype or a typed storage
  uint32_t index = 0;                    // Storage, Tensor: into the unpickler's tables
  int64_t number = 0;                    // Int, Bool
  std::string_view text, name;           // Str; Global: module and name; Other: what it is
  std::vector<Value*> items;             // Tuple, List; Dict: key, value, key, value, ...;
                                         // Object: its BUILD state (a dict or a tuple), or none
};

struct StorageEntry {
  std::string_view key, type;
  bool untyped = false;
  bool dtype_fixed = false;  // by its type, or by the first tensor that uses an untyped one
  DType dtype = DType::U8;
  uint64_t declared = 0;  // the size the persistent id gives: elements, or bytes when untyped
  uint64_t bytes = 0;
};

struct TensorEntry {
  uint32_t storage = 0;
  DType dtype = DType::U8;
  int64_t offset = 0;
  std::vector<int64_t> shape, stride;
};

// What a value is, for a message: "OrderedDict", "tuple", "collections.Counter".
std::string describe(const Value& value);

class Unpickler {
 public:
  // `data`, which must outlive the values, read as `dialect`.
  Unpickler(std::string_view data, Dialect dialect);
  ~Unpickler();
  Unpickler(const Unpickler&) = delete;
  Unpickler& operator=(const Unpickler&) = delete;

  // Runs the pickle to its STOP: the value it leaves (owned by this Unpickler, as every value it
  // built). Throws Error ("data.pkl at byte N: ...") for anything the dialect does not allow.
  Value* run();
  // What a data.pkl's persistent ids and rebuilt tensors named, as run() left them.
  const std::vector<StorageEntry>& storages() const;
  const std::vector<TensorEntry>& tensors() const;

 private:
  class Machine;
  std::unique_ptr<Machine> machine_;
};

}  // namespace vramd::storage::pickle
