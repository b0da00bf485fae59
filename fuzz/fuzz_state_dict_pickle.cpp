// libFuzzer target for torch.save checkpoints. Input that starts like a zip goes through the
// whole indexer (zip layer, unpickler, rebuilds, byte-range checks): it is either refused with
// vramd::Error or every tensor is a byte range inside the input. Any other input goes to the
// unpickler alone (a mutated data.pkl inside a zip fails its CRC, so this reaches deeper): every
// tensor must lie inside its storage. Any other input is also read as a torch.distributed.checkpoint
// .metadata: every chunk must lie inside its tensor's shape, in a file of the folder.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "storage/dcp_metadata.hpp"
#include "storage/state_dict_pickle.hpp"
#include "storage/torch_pickle.hpp"
#include "util/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    if (bytes.starts_with("PK")) {
      auto index = vramd::storage::index_torch_pickle(bytes, "");
      for (const auto& tensor : index.tensors)
        if (tensor.end < tensor.begin || tensor.end > size) std::abort();
    } else {
      auto state = vramd::storage::read_state_dict_pickle(bytes);
      for (const auto& tensor : state.tensors) {
        if (tensor.storage >= state.storages.size()) std::abort();
        if (tensor.unservable.empty() && (tensor.end < tensor.begin || tensor.end > state.storages[tensor.storage].bytes))
          std::abort();
      }
    }
  } catch (const vramd::Error&) {
  }
  if (bytes.starts_with("PK")) return 0;
  try {
    for (const auto& tensor : vramd::storage::read_dcp_metadata(bytes).tensors)
      for (const auto& chunk : tensor.chunks) {
        if (chunk.offsets.size() != tensor.shape.size() || chunk.sizes.size() != tensor.shape.size()) std::abort();
        for (size_t d = 0; d < tensor.shape.size(); ++d)
          if (chunk.offsets[d] < 0 || chunk.sizes[d] < 0 || chunk.offsets[d] + chunk.sizes[d] > tensor.shape[d]) std::abort();
        if (chunk.file.empty() || chunk.file.find('/') != std::string::npos || chunk.file == "..") std::abort();
      }
  } catch (const vramd::Error&) {
  }
  return 0;
}
