#include "storage/safetensors_writer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::storage {
namespace {

// Indices of `tensors` in file order.
std::vector<size_t> layout_order(std::span<const TensorData> tensors) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    unsigned bits_a = dtype_bits(tensors[a].dtype), bits_b = dtype_bits(tensors[b].dtype);
    return bits_a != bits_b ? bits_a > bits_b : tensors[a].name < tensors[b].name;
  });
  return order;
}

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const auto* cursor = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t wrote = ::write(fd, cursor, size);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote < 0) fail(path, std::string("write failed: ") + std::strerror(errno));
    cursor += wrote;
    size -= static_cast<size_t>(wrote);
  }
}

}  // namespace

std::string safetensors_header(std::span<const TensorData> tensors, const Metadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& meta = header["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
  }
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (size_t index : layout_order(tensors)) {
    const auto& t = tensors[index];
    if (t.name == "__metadata__") throw Error("a tensor cannot be named '__metadata__'");
    if (!names.insert(t.name).second) throw Error("tensor " + quote(t.name) + " is given twice");
    if (dtype_block(t.dtype) != 1)
      throw Error("tensor " + quote(t.name) + " is " + std::string(dtype_name(t.dtype)) +
                  ", a GGUF block type that safetensors cannot hold");
    uint64_t elements = 1;
    bool overflow = false;
    for (int64_t dim : t.shape) {
      if (dim < 0) throw Error("tensor " + quote(t.name) + " has a negative dimension");
      overflow |= __builtin_mul_overflow(elements, static_cast<uint64_t>(dim), &elements);
    }
    auto expected = overflow ? std::nullopt : dtype_bytes(t.dtype, elements);
    if (!expected || *expected != t.bytes.size())
      throw Error("tensor " + quote(t.name) + " of shape " + format_shape(t.shape) + " and dtype " +
                  std::string(dtype_name(t.dtype)) + " is given " + std::to_string(t.bytes.size()) +
                  " bytes");
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string json = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t size = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((size >> (8 * i)) & 0xff);
  return out + json;
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
  std::string header = safetensors_header(tensors, metadata);
  std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(temporary, std::string("cannot create: ") + std::strerror(errno));
  try {
    write_all(fd, header.data(), header.size(), temporary);
    for (size_t index : layout_order(tensors))
      write_all(fd, tensors[index].bytes.data(), tensors[index].bytes.size(), temporary);
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
