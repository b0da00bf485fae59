#include "storage/dcp_metadata.hpp"

#include <map>
#include <string>

#include "storage/pickle_machine.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::storage {
namespace {

using namespace pickle;

// Reads DCP's dataclasses out of the values a .metadata pickle built.
class DcpReader {
 public:
  DcpMetadata read(const Value& root) {
    const Value& metadata = object(root, "Metadata", "the pickle");
    std::map<std::pair<std::string_view, std::vector<int64_t>>, DcpChunk> stored;
    for_items(field(metadata, "storage_data"), "storage_data", [&](const Value& key, const Value& value) {
      const Value& index = object(key, "MetadataIndex", "a storage_data key");
      const std::string_view fqn = text(field(index, "fqn"), "MetadataIndex.fqn");
      const Value* at = find(index, "offset");
      if (!at || at->kind == Kind::None) return;  // a bytes entry's
      const Value& info = object(value, "_StorageInfo", "storage_data of " + quote(fqn));
      DcpChunk chunk;
      chunk.file = std::string(text(field(info, "relative_path"), "_StorageInfo.relative_path"));
      if (chunk.file.empty() || chunk.file == "." || chunk.file == ".." || chunk.file.find('/') != std::string::npos ||
          chunk.file.find('\0') != std::string::npos)
        throw Error(".metadata: the chunk of " + quote(fqn) + " is in " + quote(chunk.file) +
                    ", which is not a file in the checkpoint's folder");
      chunk.offset = natural(field(info, "offset"), "_StorageInfo.offset");
      chunk.length = natural(field(info, "length"), "_StorageInfo.length");
      if (const Value* transforms = find(info, "transform_descriptors");
          transforms && transforms->kind != Kind::None && !transforms->items.empty())
        throw Error(".metadata: the chunk of " + quote(fqn) + " in " + chunk.file +
                    " was saved through transforms (compression); vramd reads plain chunks only");
      if (!stored.emplace(std::pair{fqn, ints(*at, "MetadataIndex.offset")}, std::move(chunk)).second)
        throw Error(".metadata: storage_data lists a chunk of " + quote(fqn) + " twice");
    });

    DcpMetadata out;
    for_items(field(metadata, "state_dict_metadata"), "state_dict_metadata", [&](const Value& key, const Value& value) {
      const std::string_view name = text(key, "a state_dict_metadata key");
      if (value.kind == Kind::Object && value.name == "BytesStorageMetadata") {
        ++out.skipped;
        return;
      }
      const Value& meta = object(value, "TensorStorageMetadata", "state_dict_metadata of " + quote(name));
      DcpTensor tensor;
      tensor.name = std::string(name);
      const Value& properties = object(field(meta, "properties"), "TensorProperties", "properties of " + quote(name));
      const Value& state = *properties.items.at(0);
      const Value& dtype = state.kind == Kind::Tuple ? (state.items.empty() ? none() : *state.items[0]) : field(properties, "dtype");
      if (dtype.kind != Kind::Global || dtype.callable != Callable::DTypeName)
        throw Error(".metadata: the dtype of " + quote(name) + " is a " + describe(dtype) + ", not one vramd reads");
      tensor.dtype = dtype.dtype;
      tensor.shape = ints(field(meta, "size"), "the size of " + quote(name));
      for (int64_t size : tensor.shape)
        if (size < 0) throw Error(".metadata: " + quote(name) + " has a negative size in " + format_shape(tensor.shape));
      const Value& chunks = field(meta, "chunks");
      if (chunks.kind != Kind::List) throw Error(".metadata: the chunks of " + quote(name) + " are a " + describe(chunks));
      for (const Value* item : chunks.items) {
        const Value& chunk = object(*item, "ChunkStorageMetadata", "a chunk of " + quote(name));
        auto offsets = ints(field(chunk, "offsets"), "a chunk's offsets of " + quote(name));
        auto sizes = ints(field(chunk, "sizes"), "a chunk's sizes of " + quote(name));
        const std::string what = "the chunk of " + quote(name) + " at " + format_shape(offsets);
        bool inside = offsets.size() == tensor.shape.size() && sizes.size() == tensor.shape.size();
        for (size_t d = 0; inside && d < offsets.size(); ++d)
          inside = offsets[d] >= 0 && sizes[d] >= 0 && sizes[d] <= tensor.shape[d] && offsets[d] <= tensor.shape[d] - sizes[d];
        if (!inside)
          throw Error(".metadata: " + what + " of size " + format_shape(sizes) + " lies outside its shape " +
                      format_shape(tensor.shape));
        const auto found = stored.find(std::pair{name, offsets});
        if (found == stored.end()) throw Error(".metadata: " + what + " has no storage_data entry");
        DcpChunk placed = found->second;
        placed.offsets = std::move(offsets);
        placed.sizes = std::move(sizes);
        tensor.chunks.push_back(std::move(placed));
      }
      out.tensors.push_back(std::move(tensor));
    });
    return out;
  }

 private:
  static const Value& none() {
    static const Value value;
    return value;
  }
  static const Value& object(const Value& value, std::string_view cls, const std::string& what) {
    if (value.kind != Kind::Object || value.name != cls || value.items.empty())
      throw Error(".metadata: " + what + " is a " + describe(value) + ", not a " + std::string(cls));
    return value;
  }
  // A field of a dataclass whose state is a dict; null when it has none of that name.
  static const Value* find(const Value& object, std::string_view name) {
    const Value& state = *object.items[0];
    if (state.kind != Kind::Dict) return nullptr;
    for (size_t i = state.items.size(); i >= 2; i -= 2)  // the last of a name, as Python's dict keeps
      if (state.items[i - 2]->text == name) return state.items[i - 1];
    return nullptr;
  }
  static const Value& field(const Value& object, std::string_view name) {
    const Value* found = find(object, name);
    if (!found) throw Error(".metadata: " + describe(object) + " has no field " + quote(name));
    return *found;
  }
  static std::string_view text(const Value& value, const std::string& what) {
    if (value.kind != Kind::Str) throw Error(".metadata: " + what + " is a " + describe(value) + ", not a str");
    return value.text;
  }
  static uint64_t natural(const Value& value, const std::string& what) {
    if (value.kind != Kind::Int || value.number < 0)
      throw Error(".metadata: " + what + " is a " + describe(value) + ", not a whole number");
    return static_cast<uint64_t>(value.number);
  }
  static std::vector<int64_t> ints(const Value& value, const std::string& what) {
    if (value.kind != Kind::Tuple) throw Error(".metadata: " + what + " is a " + describe(value) + ", not a torch.Size");
    std::vector<int64_t> out;
    for (const Value* item : value.items) {
      if (item->kind != Kind::Int) throw Error(".metadata: " + what + " holds a " + describe(*item) + ", not an int");
      out.push_back(item->number);
    }
    return out;
  }
  template <typename Visit>
  static void for_items(const Value& dict, const char* what, Visit&& visit) {
    if (dict.kind != Kind::Dict) throw Error(std::string(".metadata: ") + what + " is a " + describe(dict) + ", not a dict");
    for (size_t i = 0; i < dict.items.size(); i += 2) visit(*dict.items[i], *dict.items[i + 1]);
  }
};

}  // namespace

DcpMetadata read_dcp_metadata(std::string_view data) {
  Unpickler unpickler(data, Dialect::DcpMetadata);
  return DcpReader().read(*unpickler.run());
}

}  // namespace vramd::storage
