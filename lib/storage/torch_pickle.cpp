#include "storage/torch_pickle.hpp"

#include "storage/state_dict_pickle.hpp"
#include "storage/zip_archive.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::storage {

PickleIndex index_torch_pickle(std::string_view file, std::string_view prefix, PickleRoot root) {
  if (!file.starts_with("PK\x03\x04"))
    throw Error("not a torch.save zip checkpoint; legacy pre-1.6 files must be re-saved or converted to safetensors");
  const ZipArchive zip(file);
  if (zip.members().empty()) throw Error("zip: holds no members");
  // torch.save puts every record in one folder, named after the file it saved to.
  const std::string& first = zip.members().front().name;
  const std::string folder = first.substr(0, first.find('/') + 1);
  if (folder.empty()) throw Error("zip: member " + quote(first) + " is not inside an archive folder");
  for (const auto& member : zip.members())
    if (!member.name.starts_with(folder))
      throw Error("zip: member " + quote(member.name) + " at byte " + std::to_string(member.header_offset) +
                  " is outside the archive folder " + quote(folder));

  std::string buffer;
  if (const ZipMember* byteorder = zip.find(folder + "byteorder"))
    if (zip.read(*byteorder, 16, buffer) != "little") throw Error("was saved on a big-endian machine; not supported");
  const ZipMember* pickle = zip.find(folder + "data.pkl");
  if (!pickle) throw Error("has no " + quote(folder + "data.pkl") + ": not a torch.save checkpoint");
  const auto state = read_state_dict_pickle(zip.read(*pickle, kMaxDataPklBytes, buffer), root);
  if (state.tensors.empty()) throw Error("holds no tensors");

  // Every storage the pickle declares must be a stored record that holds it.
  std::vector<const ZipMember*> records;
  records.reserve(state.storages.size());
  for (const auto& storage : state.storages) {
    const std::string name = folder + "data/" + storage.key;
    const ZipMember* record = zip.find(name);
    if (!record) throw Error("has no record " + quote(name) + " for storage " + quote(storage.key));
    if (record->deflated)
      throw Error("storage record " + quote(name) + " is compressed; vramd maps tensor data in place and reads stored "
                  "records only (torch.save writes them stored)");
    if (record->size != storage.bytes)  // torch.load refuses a record of any other size too
      throw Error("storage record " + quote(name) + " holds " + std::to_string(record->size) + " bytes; its storage " +
                  "is " + std::to_string(storage.bytes));
    records.push_back(record);
  }

  PickleIndex index;
  index.skipped = state.skipped;
  for (const auto& tensor : state.tensors) {
    if (!tensor.unservable.empty()) {
      if (tensor.name.starts_with(prefix)) throw Error(tensor.unservable);
      ++index.skipped;
      continue;
    }
    const ZipMember& record = *records[tensor.storage];
    if (tensor.begin > tensor.end || tensor.end > record.size)  // checked for every use of the storage
      throw Error("tensor " + quote(tensor.name) + " spans bytes [" + std::to_string(tensor.begin) + ", " +
                  std::to_string(tensor.end) + ") of record " + quote(record.name) + ", which holds " +
                  std::to_string(record.size));
    TensorRecord out;
    out.name = tensor.name;
    out.dtype = tensor.dtype;
    out.shape = tensor.shape;
    out.begin = record.data_offset + tensor.begin;
    out.end = record.data_offset + tensor.end;
    index.tensors.push_back(std::move(out));
  }
  return index;
}

}  // namespace vramd::storage
