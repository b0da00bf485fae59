#include "storage/torch_pickle.hpp"

#include <caffe2/serialize/inline_container.h>

#include <unordered_map>

#include "storage/state_dict_pickle.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::storage {

PickleIndex index_torch_pickle(const std::string& path, uint64_t file_size) {
  try {
    caffe2::serialize::PyTorchStreamReader zip(path);
    if (zip.hasRecord("byteorder")) {
      auto [data, size] = zip.getRecord("byteorder");
      if (std::string_view(static_cast<const char*>(data.get()), size) != "little")
        throw Error("was saved on a big-endian machine; not supported");
    }
    if (!zip.hasRecord("data.pkl")) throw Error("has no data.pkl: not a torch.save checkpoint");
    auto [pickle, pickle_size] = zip.getRecord("data.pkl");
    auto state = read_state_dict_pickle(std::string_view(static_cast<const char*>(pickle.get()), pickle_size));
    if (state.tensors.empty()) throw Error("holds no tensors");

    PickleIndex index;
    index.skipped = state.skipped;
    std::unordered_map<std::string, uint64_t> offsets;  // storage key -> its record's offset in the file
    for (auto& tensor : state.tensors) {
      auto [known, fresh] = offsets.try_emplace(tensor.storage, 0);
      if (fresh) {
        const std::string record = "data/" + tensor.storage;
        if (!zip.hasRecord(record)) throw Error("has no record for storage " + quote(tensor.storage));
        const uint64_t offset = zip.getRecordOffset(record), size = zip.getRecordSize(record);
        if (size < tensor.storage_bytes || offset > file_size || size > file_size - offset)
          throw Error("storage record " + quote(tensor.storage) + " holds " + std::to_string(size) + " bytes, " +
                      std::to_string(tensor.storage_bytes) + " needed");
        known->second = offset;
      }
      TensorRecord record;
      record.name = std::move(tensor.name);
      record.dtype = tensor.dtype;
      record.shape = std::move(tensor.shape);
      record.begin = known->second + tensor.begin;
      record.end = known->second + tensor.end;
      index.tensors.push_back(std::move(record));
    }
    return index;
  } catch (const c10::Error& e) {
    throw Error(std::string("not a torch.save zip checkpoint (") + e.what_without_backtrace() +
                "); legacy pre-1.6 files must be re-saved or converted to safetensors");
  }
}

}  // namespace vramd::storage
