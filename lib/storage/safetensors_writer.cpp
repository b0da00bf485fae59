#include "storage/safetensors_writer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"

namespace vramd::storage {
namespace {

// Indices of `tensors` in file order.
template <typename Tensor>
std::vector<size_t> layout_order(std::span<const Tensor> tensors) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    unsigned bits_a = dtype_bits(tensors[a].dtype), bits_b = dtype_bits(tensors[b].dtype);
    return bits_a != bits_b ? bits_a > bits_b : tensors[a].name < tensors[b].name;
  });
  return order;
}

// The bytes a tensor of that dtype and shape holds; throws naming it when it cannot be stored.
uint64_t stored_bytes(const std::string& name, DType dtype, const std::vector<int64_t>& shape) {
  if (name == "__metadata__") throw Error("a tensor cannot be named '__metadata__'");
  if (dtype_block(dtype) != 1)
    throw Error("tensor " + quote(name) + " is " + std::string(dtype_name(dtype)) +
                ", a GGUF block type that safetensors cannot hold");
  uint64_t elements = 1;
  bool overflow = false;
  for (int64_t dim : shape) {
    if (dim < 0) throw Error("tensor " + quote(name) + " has a negative dimension");
    overflow |= __builtin_mul_overflow(elements, static_cast<uint64_t>(dim), &elements);
  }
  const auto bytes = overflow ? std::nullopt : dtype_bytes(dtype, elements);
  if (!bytes) throw Error("tensor " + quote(name) + " of shape " + format_shape(shape) + " is too large");
  return *bytes;
}

void check_given(const std::string& name, DType dtype, const std::vector<int64_t>& shape, uint64_t given) {
  if (stored_bytes(name, dtype, shape) != given)
    throw Error("tensor " + quote(name) + " of shape " + format_shape(shape) + " and dtype " +
                std::string(dtype_name(dtype)) + " is given " + std::to_string(given) + " bytes");
}

std::vector<TensorSlot> slots_of(std::span<const TensorData> tensors) {
  std::vector<TensorSlot> slots;
  slots.reserve(tensors.size());
  for (const auto& t : tensors) {
    check_given(t.name, t.dtype, t.shape, t.bytes.size());
    slots.push_back({t.name, t.dtype, t.shape});
  }
  return slots;
}

std::string header_of(std::span<const TensorSlot> tensors, const Metadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& meta = header["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
  }
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (size_t index : layout_order(tensors)) {
    const auto& t = tensors[index];
    if (!names.insert(t.name).second) throw Error("tensor " + quote(t.name) + " is given twice");
    const uint64_t bytes = stored_bytes(t.name, t.dtype, t.shape);
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string json = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t size = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((size >> (8 * i)) & 0xff);
  return out + json;
}

}  // namespace

std::string safetensors_header(std::span<const TensorData> tensors, const Metadata& metadata) {
  return header_of(slots_of(tensors), metadata);
}

std::string serialize_safetensors(std::span<const TensorData> tensors, const Metadata& metadata) {
  std::string out = safetensors_header(tensors, metadata);
  for (size_t index : layout_order(tensors)) {
    const auto& bytes = tensors[index].bytes;
    out.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  return out;
}

void write_safetensors(const std::string& path, std::span<const TensorData> tensors,
                       const Metadata& metadata) {
  write_safetensors(path, slots_of(tensors), metadata, [&](size_t index) { return tensors[index].bytes; });
}

void write_safetensors(const std::string& path, std::span<const TensorSlot> tensors, const Metadata& metadata,
                       const std::function<std::span<const std::byte>(size_t)>& bytes_of) {
  std::string header = header_of(tensors, metadata);
  std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(temporary, std::string("cannot create: ") + std::strerror(errno));
  try {
    write_all(fd, header.data(), header.size(), temporary);
    for (size_t index : layout_order(tensors)) {
      const auto& t = tensors[index];
      const auto bytes = bytes_of(index);
      check_given(t.name, t.dtype, t.shape, bytes.size());
      write_all(fd, bytes.data(), bytes.size(), temporary);
    }
    if (::fsync(fd) != 0) fail(temporary, std::string("fsync failed: ") + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(temporary.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    int saved = errno;
    ::unlink(temporary.c_str());
    fail(path, std::string("cannot rename the finished file into place: ") + std::strerror(saved));
  }
}

}  // namespace vramd::storage
