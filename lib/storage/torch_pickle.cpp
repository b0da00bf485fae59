#include "storage/torch_pickle.hpp"

#include <torch/csrc/jit/serialization/pickle.h>

#include <cstring>
#include <fstream>

#include "storage/tensor_io.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::storage {
namespace {

constexpr uint64_t kAlignment = 64;

std::vector<char> slurp(const std::string& path) {
  std::ifstream stream(path, std::ios::binary | std::ios::ate);
  if (!stream) fail(path, "cannot open");
  std::vector<char> data(static_cast<size_t>(stream.tellg()));
  stream.seekg(0);
  if (!stream.read(data.data(), static_cast<std::streamsize>(data.size()))) fail(path, "cannot read");
  return data;
}

}  // namespace

EagerCheckpoint load_torch_pickle(const std::string& path) {
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(slurp(path));
  } catch (const c10::Error& e) {
    fail(path, std::string("not a PyTorch checkpoint LibTorch can read: ") + e.what_without_backtrace());
  }
  if (!value.isGenericDict()) fail(path, "holds a " + value.tagKind() + ", not a state dict");

  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString()) fail(path, "has a state-dict key that is not a string");
    std::string key = entry.key().toStringRef();
    if (!entry.value().isTensor())
      fail(path, "entry " + quote(key) + " is a " + entry.value().tagKind() + ", not a tensor");
    tensors.emplace_back(std::move(key), entry.value().toTensor().contiguous());
  }

  EagerCheckpoint checkpoint;
  for (const auto& [key, tensor] : tensors) {
    TensorRecord record;
    record.name = key;
    try {
      record.dtype = dtype_of(tensor.scalar_type());
    } catch (const Error& e) {
      fail(path, "tensor " + quote(key) + ": " + e.what());
    }
    record.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
    record.begin = (checkpoint.size + kAlignment - 1) / kAlignment * kAlignment;
    record.end = record.begin + tensor.nbytes();
    checkpoint.size = record.end;
    checkpoint.tensors.push_back(std::move(record));
  }
  checkpoint.data = std::shared_ptr<std::byte[]>(
      static_cast<std::byte*>(::operator new[](std::max<uint64_t>(checkpoint.size, 1), std::align_val_t(kAlignment))),
      [](std::byte* p) { ::operator delete[](p, std::align_val_t(kAlignment)); });
  for (size_t i = 0; i < tensors.size(); ++i)
    std::memcpy(checkpoint.data.get() + checkpoint.tensors[i].begin, tensors[i].second.const_data_ptr(),
                tensors[i].second.nbytes());
  return checkpoint;
}

}  // namespace vramd::storage
