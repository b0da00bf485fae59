// libFuzzer target: any bytes given to the restricted unpickler are either a state dict whose
// tensors are byte ranges inside their storages, or refused with vramd::Error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "storage/state_dict_pickle.hpp"
#include "util/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto state = vramd::storage::read_state_dict_pickle({reinterpret_cast<const char*>(data), size});
    for (const auto& tensor : state.tensors)
      if (tensor.end < tensor.begin || tensor.end > tensor.storage_bytes) std::abort();
  } catch (const vramd::Error&) {
  }
  return 0;
}
