#include "storage/state_dict_pickle.hpp"

#include <string>
#include <unordered_set>

#include "storage/pickle_machine.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::storage {
namespace {

using namespace pickle;

class Flattener {
 public:
  Flattener(const Unpickler& unpickler, PickledStateDict& out) : unpickler_(unpickler), out_(out) {}

  void dict(const std::string& prefix, const Value& dict, int depth) {
    if (depth > kMaxStateDictDepth)
      throw Error("data.pkl: dicts nested deeper than " + std::to_string(kMaxStateDictDepth) + " (the limit) under " +
                  quote(prefix));
    // A key set twice keeps its last value, as a Python dict does.
    std::unordered_set<std::string_view> seen;
    for (size_t i = dict.items.size(); i >= 2; i -= 2) {
      if (++entries_ > kMaxStateDictEntries)
        throw Error("data.pkl: more than " + std::to_string(kMaxStateDictEntries) + " entries (the limit) once flattened");
      const Value &key = *dict.items[i - 2], &value = *dict.items[i - 1];
      if (key.kind != Kind::Str) {  // an optimizer's parameter ids: not a model's state
        ++out_.skipped;
        continue;
      }
      if (!seen.insert(key.text).second) continue;
      const std::string name = prefix + std::string(key.text);
      name_bytes_ += name.size();
      if (name_bytes_ > kMaxStateDictNameBytes)
        throw Error("data.pkl: the flattened names exceed " + std::to_string(kMaxStateDictNameBytes) + " bytes (the limit)");
      if (value.kind == Kind::Dict)
        this->dict(name + ".", value, depth + 1);
      else if (value.kind == Kind::Tensor)
        tensor(name, unpickler_.tensors()[value.index]);
      else
        ++out_.skipped;
    }
  }

 private:
  // The tensor's bytes within its storage; only a tensor laid out densely is one byte range.
  void tensor(const std::string& name, const TensorEntry& tensor) {
    PickledTensor out;
    out.name = name;
    out.dtype = tensor.dtype;
    out.shape = tensor.shape;
    out.storage = tensor.storage;
    const uint64_t item = dtype_bits(tensor.dtype) / 8;
    uint64_t elements = 1;
    int64_t expected_stride = 1;
    for (size_t i = tensor.shape.size(); i-- > 0;) {
      if (tensor.shape[i] != 1 && tensor.stride[i] != expected_stride && out.unservable.empty())
        out.unservable = "tensor " + quote(name) + " is not contiguous in its storage (shape " + format_shape(tensor.shape) +
                         ", strides " + format_shape(tensor.stride) + "); save it with .contiguous() or as safetensors";
      elements *= static_cast<uint64_t>(tensor.shape[i]);  // bounded by the storage: checked when rebuilt
      expected_stride *= tensor.shape[i] == 0 ? 1 : tensor.shape[i];
    }
    if (elements == 0) {
      out.unservable.clear();  // no bytes, whatever its strides
    } else if (out.unservable.empty()) {
      out.begin = static_cast<uint64_t>(tensor.offset) * item;
      out.end = out.begin + elements * item;
    }
    out_.tensors.push_back(std::move(out));
  }

  const Unpickler& unpickler_;
  PickledStateDict& out_;
  size_t entries_ = 0, name_bytes_ = 0;
};

}  // namespace

PickledStateDict read_state_dict_pickle(std::string_view data, PickleRoot root_kind) {
  Unpickler unpickler(data, Dialect::DataPkl);  // owns every value until the state dict is flattened
  const Value* root = unpickler.run();
  PickledStateDict state;
  for (const auto& storage : unpickler.storages())
    state.storages.push_back(PickledStorage{std::string(storage.key), storage.dtype, storage.bytes});
  if (root_kind == PickleRoot::Tensor) {
    if (root->kind != Kind::Tensor) throw Error("data.pkl holds a " + describe(*root) + ", not a tensor");
    Value dict;  // {"": the tensor}
    dict.kind = Kind::Dict;
    Value name;
    name.kind = Kind::Str;
    dict.items = {&name, const_cast<Value*>(root)};
    Flattener(unpickler, state).dict("", dict, 0);
    return state;
  }
  if (root->kind != Kind::Dict) throw Error("data.pkl holds a " + describe(*root) + ", not a state dict");
  Flattener(unpickler, state).dict("", *root, 0);
  return state;
}

}  // namespace vramd::storage
