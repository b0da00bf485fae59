#include "storage/tensor_io.hpp"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstring>

#include "storage/dequantize.hpp"
#include "storage/dequantize_ops.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::storage {
namespace {

struct Pair {
  DType dtype;
  c10::ScalarType type;
};

constexpr Pair kPairs[] = {
    {DType::BOOL, c10::kBool},           {DType::U8, c10::kByte},
    {DType::I8, c10::kChar},             {DType::U16, c10::kUInt16},
    {DType::I16, c10::kShort},           {DType::U32, c10::kUInt32},
    {DType::I32, c10::kInt},             {DType::U64, c10::kUInt64},
    {DType::I64, c10::kLong},            {DType::F16, c10::kHalf},
    {DType::BF16, c10::kBFloat16},       {DType::F32, c10::kFloat},
    {DType::F64, c10::kDouble},          {DType::C64, c10::kComplexFloat},
    {DType::F8_E4M3, c10::ScalarType::Float8_e4m3fn},
    {DType::F8_E5M2, c10::ScalarType::Float8_e5m2},
    {DType::F8_E8M0, c10::ScalarType::Float8_e8m0fnu},
};

// Contiguous CPU tensors, kept alive beside the TensorData that point into them.
struct Staged {
  std::vector<at::Tensor> keep;
  std::vector<TensorData> data;
};

Staged stage(const NamedTensors& tensors) {
  Staged staged;
  staged.keep.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) throw Error("tensor " + quote(name) + " is undefined");
    at::Tensor cpu = tensor.to(c10::kCPU).contiguous();
    staged.keep.push_back(cpu);
    staged.data.push_back(TensorData{
        name, dtype_of(cpu.scalar_type()), std::vector<int64_t>(cpu.sizes().begin(), cpu.sizes().end()),
        {static_cast<const std::byte*>(cpu.const_data_ptr()), cpu.nbytes()}});
  }
  return staged;
}

}  // namespace

c10::ScalarType scalar_type(DType dtype) {
  for (const auto& pair : kPairs)
    if (pair.dtype == dtype) return pair.type;
  throw Error("dtype " + std::string(dtype_name(dtype)) + " has no LibTorch equivalent");
}

DType dtype_of(c10::ScalarType type) {
  for (const auto& pair : kPairs)
    if (pair.type == type) return pair.dtype;
  throw Error(std::string("LibTorch dtype ") + c10::toString(type) + " cannot be stored in safetensors");
}

std::string torch_name(c10::ScalarType type) {
  for (const auto& pair : kPairs)
    if (pair.type == type) return std::string(torch_dtype_name(pair.dtype));
  return c10::toString(type);
}

c10::ScalarType scalar_type(const DiskMap& map, const TensorInfo& info) {
  try {
    return scalar_type(info.dtype);
  } catch (const Error& e) {
    fail(map.files()[info.file].path, "tensor " + quote(info.key) + ": " + e.what());
  }
}

at::Tensor unpacked(const DiskMap& map, const TensorInfo& info, std::span<const std::byte> packed) {
  at::Tensor tensor = at::empty(info.shape, at::TensorOptions().dtype(c10::kFloat));
  try {
    dequantize(info.dtype, packed, {tensor.mutable_data_ptr<float>(), static_cast<size_t>(tensor.numel())});
  } catch (const Error& e) {
    fail(map.files()[info.file].path, "tensor " + quote(info.key) + ": " + e.what());
  }
  return tensor;
}

at::Tensor view_or_copy(std::span<const std::byte> bytes, c10::ScalarType type, c10::IntArrayRef shape,
                        std::shared_ptr<void> owner) {
  const auto cpu = at::TensorOptions().dtype(type).device(c10::kCPU);
  auto* data = const_cast<std::byte*>(bytes.data());  // read-only in intent: views are never written
  if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(type) == 0)
    return at::from_blob(data, shape, [owner = std::move(owner)](void*) {}, cpu);
  at::Tensor tensor = at::empty(shape, cpu);
  if (!bytes.empty()) std::memcpy(tensor.mutable_data_ptr(), data, bytes.size());
  return tensor;
}

// The tensor's bytes as they are stored, shaped `shape` in `type`: a view of the mapping where
// `mode` allows and the bytes are aligned for `type`, else read into fresh memory.
at::Tensor stored_bytes(const DiskMap& map, const TensorInfo& info, c10::ScalarType type, c10::IntArrayRef shape,
                        ReadMode mode) {
  if (mode == ReadMode::Auto) {
    const auto [bytes, owner] = map.bytes(info);
    return view_or_copy(bytes, type, shape, owner);
  }
  at::Tensor tensor = at::empty(shape, at::TensorOptions().dtype(type).device(c10::kCPU));
  std::span<std::byte> dst(static_cast<std::byte*>(tensor.mutable_data_ptr()), info.nbytes);
  if (mode == ReadMode::Direct)
    map.read_direct(info, dst);
  else
    map.read(info, dst);
  return tensor;
}

at::Tensor load_tensor(const DiskMap& map, const TensorInfo& info, const ReadOptions& options) {
  if (dtype_block(info.dtype) != 1) {  // GGUF's block types: as stored, or unpacked to float32
    if (options.dtype == c10::kByte) return stored_bytes(map, info, c10::kByte, packed_shape(info.dtype, info.shape), options.mode);
    std::vector<std::byte> packed(info.nbytes);
    if (options.mode == ReadMode::Direct)
      map.read_direct(info, packed);
    else
      map.read(info, packed);
    at::Tensor tensor = unpacked(map, info, packed);
    return options.dtype ? tensor.to(*options.dtype) : tensor;  // to() of the same dtype is the tensor itself
  }
  const c10::ScalarType type = scalar_type(map, info);
  at::Tensor tensor = stored_bytes(map, info, type, info.shape, options.mode);
  if (options.dtype && *options.dtype != type) tensor = tensor.to(*options.dtype);
  return tensor;
}

namespace {

void unmap(void* context) { delete static_cast<Mapping*>(context); }

}  // namespace

at::Tensor map_tensor(const DiskMap& map, const TensorInfo& info) {
  const bool packed = dtype_block(info.dtype) != 1;
  const c10::ScalarType type = packed ? c10::kByte : scalar_type(map, info);
  if (info.nbytes == 0 || info.offset % c10::elementSize(type) != 0) return {};
  auto mapping = map.map_range(info);
  std::byte* data = mapping->data() + (mapping->size() - info.nbytes);
  return at::for_blob(data, packed ? packed_shape(info.dtype, info.shape) : info.shape)
      .context(mapping.release(), &unmap)
      .options(at::TensorOptions().dtype(type).device(c10::kCPU))
      .make_tensor();
}

bool is_mapped_view(const at::Tensor& tensor) {
  return tensor.has_storage() && tensor.storage().data_ptr().get_deleter() == &unmap;
}

// The buffer fills from its end: each step carries the elements [begin, end) across as they are
// into out's first bytes, which none of their results occupy ((end - begin) * in <= begin * out
// bytes), and casts them into place. What is left once a step would take fewer than 64 Ki
// elements is cast by copy_. A float8 to bfloat16 cast of 64 Mi elements takes 7 steps.
void cast_into(const at::Tensor& value, at::Tensor& out) {
  if (!value.is_contiguous() || !out.is_contiguous()) throw Error("cast_into needs contiguous tensors");
  if (value.numel() != out.numel())
    throw Error("cast_into cannot cast " + std::to_string(value.numel()) + " elements into " + std::to_string(out.numel()));
  constexpr int64_t kCopyElements = 64 << 10;
  const at::Tensor from = value.view({-1}), to = out.view({-1});
  const at::Tensor bytes = to.view(c10::kByte);
  const int64_t in = value.element_size(), width = in + out.element_size();
  int64_t end = from.numel();
  while (value.scalar_type() != out.scalar_type() && end > kCopyElements) {
    const int64_t begin = (end * in + width - 1) / width;
    at::Tensor carried = bytes.narrow(0, 0, (end - begin) * in).view(value.scalar_type());
    carried.copy_(from.narrow(0, begin, end - begin), /*non_blocking=*/value.is_pinned());
    to.narrow(0, begin, end - begin).copy_(carried);
    end = begin;
  }
  if (end > 0) to.narrow(0, 0, end).copy_(from.narrow(0, 0, end));
}

at::Tensor load_tensor(const DiskMap& map, std::string_view name, const ReadOptions& options) {
  return load_tensor(map, map.at(name), options);
}

std::string serialize_tensors(const NamedTensors& tensors, const Metadata& metadata) {
  auto staged = stage(tensors);
  return serialize_safetensors(staged.data, metadata);
}

void save_tensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata) {
  auto staged = stage(tensors);
  write_safetensors(path, staged.data, metadata);
}

}  // namespace vramd::storage
