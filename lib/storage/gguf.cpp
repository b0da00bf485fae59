#include "storage/gguf.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::storage {
namespace {

static_assert(std::endian::native == std::endian::little, "GGUF is read as little-endian");

using Json = nlohmann::ordered_json;

// GGUF's metadata value types.
enum ValueType : uint32_t { U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 };
constexpr const char* kValueTypeNames[] = {"uint8", "int8",  "uint16", "int16", "uint32", "int32", "float32",
                                           "bool",  "string", "array", "uint64", "int64", "float64"};
constexpr unsigned kValueSizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};  // 0: variable

// ggml's type ids for the types vramd reads, and the names of those it does not.
struct GgmlType {
  uint32_t id;
  DType dtype;
};
constexpr GgmlType kGgmlTypes[] = {
    {0, DType::F32},   {1, DType::F16},   {2, DType::Q4_0},  {3, DType::Q4_1},  {6, DType::Q5_0},
    {7, DType::Q5_1},  {8, DType::Q8_0},  {9, DType::Q8_1},  {10, DType::Q2_K}, {11, DType::Q3_K},
    {12, DType::Q4_K}, {13, DType::Q5_K}, {14, DType::Q6_K}, {15, DType::Q8_K}, {24, DType::I8},
    {25, DType::I16},  {26, DType::I32},  {27, DType::I64},  {28, DType::F64},  {30, DType::BF16},
};
constexpr std::pair<uint32_t, const char*> kUnreadTypes[] = {
    {16, "IQ2_XXS"}, {17, "IQ2_XS"}, {18, "IQ3_XXS"}, {19, "IQ1_S"}, {20, "IQ4_NL"}, {21, "IQ3_S"},
    {22, "IQ2_S"},   {23, "IQ4_XS"}, {29, "IQ1_M"},   {34, "TQ1_0"}, {35, "TQ2_0"},  {39, "MXFP4"},
};

constexpr size_t kShownArray = 64;       // longer arrays are summarised
constexpr uint64_t kMaxName = 4096;      // bytes of a key or a tensor's name
constexpr uint32_t kMaxDims = 4;         // ggml's GGML_MAX_DIMS
constexpr uint64_t kMinTensorInfo = 33;  // name length and one byte, dims, one dim, type, offset
constexpr uint64_t kMinKeyValue = 14;    // key length and one byte, type, one byte of value

// A cursor over the file's first bytes that knows how long the file is: running out of bytes
// inside the file asks for more (GgufNeedsMore), past its end is an error saying where.
class Cursor {
 public:
  Cursor(std::span<const std::byte> bytes, uint64_t file_size) : bytes_(bytes), file_size_(file_size) {}

  std::string where;  // what is being read, for messages

  uint64_t position() const { return position_; }

  void need(uint64_t n) {
    if (n <= bytes_.size() - position_) return;
    const uint64_t end = n > file_size_ - std::min(position_, file_size_) ? file_size_ + 1 : position_ + n;
    if (end > file_size_)
      throw Error("the file ends inside " + where + " (" + std::to_string(file_size_) + " bytes; " +
                  std::to_string(n) + " more needed from byte " + std::to_string(position_) + ")");
    if (end > kMaxGgufHeaderSize)
      throw Error("the header reaches past " + format_bytes(kMaxGgufHeaderSize) + " at " + where +
                  ", more than vramd reads before the tensor data");
    throw GgufNeedsMore{end};
  }

  template <typename T>
  T read() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, bytes_.data() + position_, sizeof(T));
    position_ += sizeof(T);
    return value;
  }

  void skip(uint64_t n) {
    need(n);
    position_ += n;
  }

  std::string_view bytes(uint64_t n) {
    need(n);
    std::string_view text(reinterpret_cast<const char*>(bytes_.data() + position_), n);
    position_ += n;
    return text;
  }

  std::string_view string(uint64_t limit) {
    const auto length = read<uint64_t>();
    if (length > limit) throw Error(where + " has a string of " + std::to_string(length) + " bytes (at most " +
                                    std::to_string(limit) + ")");
    return bytes(length);
  }

 private:
  std::span<const std::byte> bytes_;
  uint64_t file_size_;
  uint64_t position_ = 0;
};

std::string value_type_name(uint32_t type) { return type <= F64 ? kValueTypeNames[type] : std::to_string(type); }

uint32_t read_value_type(Cursor& in) {
  const auto type = in.read<uint32_t>();
  if (type > F64) throw Error(in.where + " has an unknown value type " + std::to_string(type));
  return type;
}

Json read_scalar(Cursor& in, uint32_t type) {
  switch (type) {
    case U8: return in.read<uint8_t>();
    case I8: return in.read<int8_t>();
    case U16: return in.read<uint16_t>();
    case I16: return in.read<int16_t>();
    case U32: return in.read<uint32_t>();
    case I32: return in.read<int32_t>();
    case F32: return in.read<float>();
    case U64: return in.read<uint64_t>();
    case I64: return in.read<int64_t>();
    case F64: return in.read<double>();
    case BOOL: {
      const auto value = in.read<uint8_t>();
      if (value > 1) throw Error(in.where + " is a bool holding " + std::to_string(value));
      return value == 1;
    }
    default: return escape_invalid_utf8(in.string(kMaxGgufHeaderSize));  // STRING
  }
}

// A value as JSON text; arrays longer than kShownArray are skipped over and summarised.
std::string read_value(Cursor& in, uint32_t type) {
  if (type != ARRAY) return read_scalar(in, type).dump();
  const uint32_t element = read_value_type(in);
  if (element == ARRAY) throw Error(in.where + " is an array of arrays, which GGUF readers do not take");
  const auto count = in.read<uint64_t>();
  if (count > kShownArray) {
    if (element == STRING) {
      for (uint64_t i = 0; i < count; ++i) in.string(kMaxGgufHeaderSize);
    } else {
      if (count > std::numeric_limits<uint64_t>::max() / kValueSizes[element])
        throw Error(in.where + " is an array of " + std::to_string(count) + " elements, more than a file holds");
      in.skip(count * kValueSizes[element]);
    }
    return Json("[" + std::to_string(count) + " " + value_type_name(element) + "s]").dump();
  }
  Json array = Json::array();
  for (uint64_t i = 0; i < count; ++i) array.push_back(read_scalar(in, element));
  return array.dump();
}

std::string type_list() {
  std::string names;
  for (const auto& type : kGgmlTypes) names += (names.empty() ? "" : ", ") + std::string(dtype_name(type.dtype));
  return names;
}

DType read_ggml_type(Cursor& in) {
  const auto id = in.read<uint32_t>();
  for (const auto& type : kGgmlTypes)
    if (type.id == id) return type.dtype;
  std::string name;
  for (const auto& [unread, text] : kUnreadTypes)
    if (unread == id) name = std::string(" (") + text + ")";
  throw Error(in.where + " has ggml type " + std::to_string(id) + name + ", which vramd does not read (it reads " +
              type_list() + ")");
}

std::string read_name(Cursor& in, const char* what) {
  std::string name(in.string(kMaxName));
  if (name.empty()) throw Error(in.where + " has an empty " + what);
  if (!valid_utf8(name)) throw Error(in.where + " has a " + what + " that is not UTF-8: " + quote(escape_invalid_utf8(name)));
  return name;
}

// The tensor's size in bytes, with its dimensions checked: at most 4, each a whole number of
// blocks in the innermost one, the total within 64 bits.
uint64_t tensor_bytes(const Cursor& in, DType dtype, const std::vector<uint64_t>& dims) {
  uint64_t elements = 1;
  for (uint64_t dim : dims) {
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        __builtin_mul_overflow(elements, dim, &elements))
      throw Error(in.where + " has dimensions whose product overflows 64 bits");
  }
  if (dims[0] % dtype_block(dtype) != 0)
    throw Error(in.where + " is " + std::string(dtype_name(dtype)) + ", in blocks of " +
                std::to_string(dtype_block(dtype)) + " elements, but its rows hold " + std::to_string(dims[0]));
  const auto bytes = dtype_bytes(dtype, elements);
  if (!bytes) throw Error(in.where + " has more bytes than 64 bits count");
  return *bytes;
}

}  // namespace

bool is_gguf(std::span<const std::byte> first_bytes) {
  return first_bytes.size() >= 4 && std::memcmp(first_bytes.data(), "GGUF", 4) == 0;
}

GgufHeader parse_gguf(std::span<const std::byte> bytes, uint64_t file_size) {
  if (bytes.size() > file_size) throw Error("parse_gguf: more bytes than the file holds");
  Cursor in(bytes, file_size);
  in.where = "the header";
  in.need(4);
  if (!is_gguf(bytes)) throw Error("not a GGUF file (no \"GGUF\" magic)");
  in.skip(4);
  GgufHeader header;
  header.version = in.read<uint32_t>();
  if (header.version == 1)
    throw Error("GGUF version 1 (32-bit counts, from before August 2023) is not read; convert the model again");
  if (header.version != 2 && header.version != 3) {
    if (header.version != 0 && (header.version & 0xffff) == 0)
      throw Error("a big-endian GGUF file (version " + std::to_string(__builtin_bswap32(header.version)) +
                  "); vramd reads little-endian ones");
    throw Error("GGUF version " + std::to_string(header.version) + " is not read (versions 2 and 3 are)");
  }
  const auto tensor_count = in.read<uint64_t>();
  const auto kv_count = in.read<uint64_t>();
  const uint64_t room = std::min(file_size, kMaxGgufHeaderSize);
  if (tensor_count > room / kMinTensorInfo || kv_count > room / kMinKeyValue ||
      tensor_count * kMinTensorInfo + kv_count * kMinKeyValue > room)
    throw Error(std::to_string(tensor_count) + " tensors and " + std::to_string(kv_count) +
                " metadata keys cannot fit in a header of at most " + std::to_string(room) + " bytes");

  std::set<std::string, std::less<>> keys;
  for (uint64_t i = 0; i < kv_count; ++i) {
    in.where = "metadata key " + std::to_string(i);
    std::string key = read_name(in, "key");
    in.where = "metadata key " + quote(key);
    if (!keys.insert(key).second) throw Error(in.where + " is given twice");
    const uint32_t type = read_value_type(in);
    if (key == "general.alignment") {
      if (type != U32) throw Error(in.where + " must be a uint32, found " + value_type_name(type));
      const auto alignment = in.read<uint32_t>();
      if (alignment == 0 || !std::has_single_bit(alignment))
        throw Error(in.where + " is " + std::to_string(alignment) + ", not a power of two");
      header.alignment = alignment;
      header.metadata.emplace_back(std::move(key), std::to_string(alignment));
      continue;
    }
    std::string value = read_value(in, type);
    header.metadata.emplace_back(std::move(key), std::move(value));
  }

  std::set<std::string, std::less<>> names;
  std::vector<uint64_t> dims;
  for (uint64_t i = 0; i < tensor_count; ++i) {
    in.where = "tensor " + std::to_string(i);
    TensorRecord record;
    record.name = read_name(in, "name");
    in.where = "tensor " + quote(record.name);
    if (!names.insert(record.name).second) throw Error(in.where + " is given twice");
    const auto n_dims = in.read<uint32_t>();
    if (n_dims == 0 || n_dims > kMaxDims)
      throw Error(in.where + " has " + std::to_string(n_dims) + " dimensions (1 to 4)");
    dims.resize(n_dims);
    for (auto& dim : dims) dim = in.read<uint64_t>();
    record.dtype = read_ggml_type(in);
    const uint64_t nbytes = tensor_bytes(in, record.dtype, dims);
    record.begin = in.read<uint64_t>();
    if (record.begin % header.alignment != 0)
      throw Error(in.where + " starts at offset " + std::to_string(record.begin) + ", not a multiple of the alignment " +
                  std::to_string(header.alignment));
    if (__builtin_add_overflow(record.begin, nbytes, &record.end))
      throw Error(in.where + " ends past 64 bits of offset");
    record.shape.assign(dims.rbegin(), dims.rend());  // ggml counts dimensions innermost first
    header.tensors.push_back(std::move(record));
  }

  const uint64_t header_end = in.position();
  header.data_offset = (header_end + header.alignment - 1) / header.alignment * header.alignment;
  if (header.data_offset > file_size)
    throw Error("the tensor data would start at byte " + std::to_string(header.data_offset) + ", past the end of the file (" +
                std::to_string(file_size) + " bytes)");
  const uint64_t data_size = file_size - header.data_offset;
  std::vector<const TensorRecord*> by_offset;
  for (const auto& tensor : header.tensors) {
    if (tensor.end > data_size)
      throw Error("tensor " + quote(tensor.name) + " ends at byte " + std::to_string(header.data_offset + tensor.end) +
                  ", past the end of the file (" + std::to_string(file_size) + " bytes)");
    if (tensor.end > tensor.begin) by_offset.push_back(&tensor);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      throw Error("tensors " + quote(by_offset[i - 1]->name) + " and " + quote(by_offset[i]->name) + " overlap");
  return header;
}

}  // namespace vramd::storage
