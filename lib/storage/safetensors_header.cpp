#include "storage/safetensors_header.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <simdjson.h>
#include <unordered_set>

#include "util/error.hpp"
#include "util/format.hpp"
#include "util/sort.hpp"

namespace vramd::storage {
namespace {

using simdjson::dom::element;
using simdjson::dom::element_type;

std::string offsets_text(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

std::string_view json_type_name(element_type type) {
  switch (type) {
    case element_type::ARRAY: return "an array";
    case element_type::OBJECT: return "an object";
    case element_type::INT64:
    case element_type::UINT64:
    case element_type::DOUBLE: return "a number";
    case element_type::STRING: return "a string";
    case element_type::BOOL: return "a boolean";
    case element_type::NULL_VALUE: return "null";
  }
  return "a value";
}

[[noreturn]] void fail_tensor(std::string_view name, const std::string& message) {
  throw Error("tensor " + quote(name) + " " + message);
}

uint64_t read_uint(element value, std::string_view tensor, std::string_view field) {
  uint64_t number = 0;
  if (value.get_uint64().get(number) != simdjson::SUCCESS)
    fail_tensor(tensor, "has a " + std::string(field) + " entry that is " +
                            std::string(json_type_name(value.type())) +
                            (value.type() == element_type::INT64 ? " below zero" : "") +
                            ", not a non-negative integer");
  return number;
}

std::vector<std::pair<std::string, std::string>> parse_metadata(element value) {
  std::vector<std::pair<std::string, std::string>> metadata;
  if (value.is_null()) return metadata;
  simdjson::dom::object object;
  if (value.get_object().get(object) != simdjson::SUCCESS)
    throw Error("__metadata__ is " + std::string(json_type_name(value.type())) +
                ", not an object of strings");
  std::unordered_set<std::string_view> seen;
  for (auto field : object) {
    if (!seen.insert(field.key).second)
      throw Error("__metadata__ has the key " + quote(field.key) + " twice");
    std::string_view text;
    if (field.value.get_string().get(text) != simdjson::SUCCESS)
      throw Error("__metadata__ value for key " + quote(field.key) + " is " +
                  std::string(json_type_name(field.value.type())) +
                  "; metadata values must be strings");
    metadata.emplace_back(field.key, text);
  }
  return metadata;
}

TensorRecord parse_tensor(std::string_view name, element value) {
  simdjson::dom::object object;
  if (value.get_object().get(object) != simdjson::SUCCESS)
    fail_tensor(name, "is " + std::string(json_type_name(value.type())) +
                          ", not an object with dtype, shape and data_offsets");
  TensorRecord record;
  record.name = name;
  bool has_dtype = false, has_shape = false, has_offsets = false;
  for (auto field : object) {
    if (field.key == "dtype") {
      if (has_dtype) fail_tensor(name, "has the field 'dtype' twice");
      has_dtype = true;
      std::string_view text;
      if (field.value.get_string().get(text) != simdjson::SUCCESS)
        fail_tensor(name, "has a dtype that is " + std::string(json_type_name(field.value.type())) +
                              ", not a string");
      auto dtype = parse_dtype(text);
      if (!dtype) fail_tensor(name, "has unknown dtype " + quote(text));
      record.dtype = *dtype;
    } else if (field.key == "shape") {
      if (has_shape) fail_tensor(name, "has the field 'shape' twice");
      has_shape = true;
      simdjson::dom::array dims;
      if (field.value.get_array().get(dims) != simdjson::SUCCESS)
        fail_tensor(name, "has a shape that is " + std::string(json_type_name(field.value.type())) +
                              ", not an array");
      for (element dim : dims) {
        uint64_t size = read_uint(dim, name, "shape");
        if (size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          fail_tensor(name, "has a shape entry " + std::to_string(size) + " beyond int64");
        record.shape.push_back(static_cast<int64_t>(size));
      }
    } else if (field.key == "data_offsets") {
      if (has_offsets) fail_tensor(name, "has the field 'data_offsets' twice");
      has_offsets = true;
      simdjson::dom::array offsets;
      if (field.value.get_array().get(offsets) != simdjson::SUCCESS || offsets.size() != 2)
        fail_tensor(name, "has data_offsets that are not an array of two integers");
      record.begin = read_uint(offsets.at(0).value_unsafe(), name, "data_offsets");
      record.end = read_uint(offsets.at(1).value_unsafe(), name, "data_offsets");
    } else {
      fail_tensor(name, "has unknown field " + quote(field.key) +
                            " (expected dtype, shape, data_offsets)");
    }
  }
  if (!has_dtype) fail_tensor(name, "has no dtype");
  if (!has_shape) fail_tensor(name, "has no shape");
  if (!has_offsets) fail_tensor(name, "has no data_offsets");
  return record;
}

void check_size(const TensorRecord& t, uint64_t data_size) {
  if (t.end < t.begin)
    fail_tensor(t.name, "has data_offsets " + offsets_text(t.begin, t.end) + ": end before start");
  if (t.end > data_size)
    fail_tensor(t.name, "has data_offsets " + offsets_text(t.begin, t.end) +
                            " past the end of the data region (" + std::to_string(data_size) +
                            " bytes); is the file truncated?");
  uint64_t elements = 1;
  for (int64_t dim : t.shape)
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(dim), &elements))
      fail_tensor(t.name, "has shape " + format_shape(t.shape) + " whose element count overflows");
  uint64_t bits = 0;
  if (__builtin_mul_overflow(elements, static_cast<uint64_t>(dtype_bits(t.dtype)), &bits))
    fail_tensor(t.name, "has shape " + format_shape(t.shape) + " whose byte size overflows");
  if (bits % 8 != 0)
    fail_tensor(t.name, "has shape " + format_shape(t.shape) + " of " +
                            std::string(dtype_name(t.dtype)) + ", which is not a whole number of bytes");
  if (bits / 8 != t.end - t.begin)
    fail_tensor(t.name, "has shape " + format_shape(t.shape) + " of " +
                            std::string(dtype_name(t.dtype)) + " (" + std::to_string(bits / 8) +
                            " bytes) but data_offsets " + offsets_text(t.begin, t.end) + " span " +
                            std::to_string(t.end - t.begin) + " bytes");
}

// The tensors must tile [0, data_size) exactly: no holes, no overlaps, no trailing bytes.
void check_tiling(const std::vector<TensorRecord>& tensors, uint64_t data_size) {
  struct Span {
    uint64_t begin, end;
    uint32_t index;
  };
  std::vector<Span> spans(tensors.size());
  for (uint32_t i = 0; i < spans.size(); ++i) spans[i] = {tensors[i].begin, tensors[i].end, i};
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t position = 0;
  const TensorRecord* previous = nullptr;
  for (const auto& span : spans) {
    const auto& t = tensors[span.index];
    if (t.begin < position)
      fail_tensor(t.name, "has data_offsets " + offsets_text(t.begin, t.end) +
                              " overlapping tensor " + quote(previous->name) + " at " +
                              offsets_text(previous->begin, previous->end));
    if (t.begin > position)
      fail_tensor(t.name, "has data_offsets " + offsets_text(t.begin, t.end) +
                              ", leaving a hole of " + std::to_string(t.begin - position) +
                              " bytes at offset " + std::to_string(position));
    position = t.end;
    previous = &t;
  }
  if (position != data_size)
    throw Error("the data region has " + std::to_string(data_size - position) +
                " trailing bytes after the last tensor (" + std::to_string(data_size) +
                " bytes, tensors cover " + std::to_string(position) + ")");
}

// Sorts by name and refuses a name given twice.
void sort_by_name(std::vector<TensorRecord>& tensors) {
  sort_by(tensors, [](const TensorRecord& t) -> const std::string& { return t.name; });
  auto twin = std::adjacent_find(tensors.begin(), tensors.end(),
                                 [](const TensorRecord& a, const TensorRecord& b) { return a.name == b.name; });
  if (twin != tensors.end()) throw Error("header has the tensor " + quote(twin->name) + " twice");
}

uint64_t read_le64(const std::byte* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(bytes[i]);
  return value;
}

uint64_t check_header_length(uint64_t header_size, uint64_t file_size) {
  if (file_size < 8)
    throw Error("file is " + std::to_string(file_size) +
                " bytes, too small to hold a safetensors header length");
  if (header_size > kMaxHeaderSize)
    throw Error("header length " + std::to_string(header_size) + " exceeds the limit of " +
                std::to_string(kMaxHeaderSize) + " bytes");
  if (header_size > file_size - 8)
    throw Error("header length " + std::to_string(header_size) + " runs past the end of the file (" +
                std::to_string(file_size) + " bytes)");
  return file_size - 8 - header_size;
}

// `padded`: json is followed by at least SIMDJSON_PADDING readable bytes, so no copy is needed.
SafetensorsHeader parse_header(std::string_view json, bool padded, uint64_t data_size) {
  if (json.empty() || json.front() != '{')
    throw Error("header does not start with '{'; this is not a safetensors file");
  if (!simdjson::validate_utf8(json.data(), json.size()))
    throw Error("header is not valid UTF-8");
  simdjson::dom::parser parser;
  element root;
  if (auto error = parser.parse(json.data(), json.size(), !padded).get(root))
    throw Error(std::string("header is not valid JSON: ") + simdjson::error_message(error));
  simdjson::dom::object object;
  if (root.get_object().get(object) != simdjson::SUCCESS)
    throw Error("header is not a JSON object");

  SafetensorsHeader header;
  header.tensors.reserve(object.size());
  bool has_metadata = false;
  for (auto field : object) {
    if (field.key == "__metadata__") {
      if (has_metadata) throw Error("header has the key '__metadata__' twice");
      has_metadata = true;
      header.metadata = parse_metadata(field.value);
      continue;
    }
    header.tensors.push_back(parse_tensor(field.key, field.value));
    check_size(header.tensors.back(), data_size);
  }
  sort_by_name(header.tensors);
  check_tiling(header.tensors, data_size);
  return header;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_size) {
  return parse_header(json, false, data_size);
}

SafetensorsHeader parse_safetensors_file(std::span<const std::byte> file) {
  uint64_t header_size = file.size() >= 8 ? read_le64(file.data()) : 0;
  uint64_t data_size = check_header_length(header_size, file.size());
  auto header = parse_safetensors_header(
      std::string_view(reinterpret_cast<const char*>(file.data()) + 8, header_size), data_size);
  header.data_offset = 8 + header_size;
  return header;
}

SafetensorsHeader read_safetensors_header(int fd, uint64_t file_size) {
  auto read_exact = [fd](void* buffer, size_t size, uint64_t offset) {
    auto* cursor = static_cast<char*>(buffer);
    while (size > 0) {
      ssize_t got = ::pread(fd, cursor, size, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw Error(std::string("cannot read the header: ") + std::strerror(errno));
      if (got == 0) throw Error("file shrank while its header was read");
      cursor += got;
      size -= static_cast<size_t>(got);
      offset += static_cast<uint64_t>(got);
    }
  };
  std::byte prefix[8] = {};
  if (file_size >= 8) read_exact(prefix, 8, 0);
  uint64_t header_size = file_size >= 8 ? read_le64(prefix) : 0;
  uint64_t data_size = check_header_length(header_size, file_size);
  simdjson::padded_string json(header_size);
  read_exact(json.data(), header_size, 8);
  auto header = parse_header(std::string_view(json.data(), header_size), true, data_size);
  header.data_offset = 8 + header_size;
  return header;
}

}  // namespace vramd::storage
