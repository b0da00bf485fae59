#include "weights/source.hpp"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "convert/evaluate.hpp"
#include "storage/dequantize_ops.hpp"
#include "storage/device_staging.hpp"
#include "storage/file.hpp"
#include "storage/page_cache.hpp"
#include "storage/tensor_io.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/torch_cuda.hpp"

namespace vramd::weights {

c10::ScalarType state_dtype(const config::Dtype& dtype, c10::ScalarType otherwise) {
  return dtype ? storage::scalar_type(*dtype) : otherwise;
}

bool packed_state(const config::DeviceState& state, const config::ModelConfig& config) {
  if (state.device.is_disk() || config.partition.world_size > 1) return false;
  return state.packed.value_or(config.vram.limit.has_value());
}

void check_packed(const Source& source, const config::ModelConfig& config) {
  const auto& vram = config.vram;
  const char* key = vram.preparing.packed == true ? "preparing" : vram.onload.packed == true ? "onload"
                  : vram.offload.packed == true ? "offload" : nullptr;
  if (!key || std::any_of(source.assignments.begin(), source.assignments.end(), [](const Assignment& a) { return a.block; }))
    return;
  bool blocks = false;
  for (const auto& info : source.map.tensors()) blocks = blocks || storage::dtype_block(info.dtype) != 1;
  fail(config::where(config, std::string("vram.") + key + ".packed"), std::string("vram.") + key + ".packed = true, but no weight of " + source.map.description() +
                        " can stay packed: " +
                        (blocks ? "the converter's expressions cut the rows of its GGUF blocks apart, or change their values"
                                : "it holds no GGUF block-quantized tensor (Q4_0 ... Q6_K)") +
                        "; remove packed = true");
}

bool held_as_is(storage::DType dtype) { return !storage::is_floating(dtype) && dtype != storage::DType::U8; }

c10::ScalarType held_dtype(const Assignment& a, c10::ScalarType dtype, bool packed) {
  if (held_as_is(a.expr->dtype)) return storage::scalar_type(a.expr->dtype);
  return packed && a.block ? kPacked : dtype;
}

uint64_t held_bytes(const Assignment& a, c10::ScalarType held) {
  const auto elements = static_cast<uint64_t>(a.parameter->elements());
  return held == kPacked ? storage::dtype_bytes(*a.block, elements).value() : elements * c10::elementSize(held);
}

std::vector<int64_t> held_shape(const Assignment& a, c10::ScalarType held) {
  return held == kPacked ? storage::packed_shape(*a.block, a.parameter->shape) : a.parameter->shape;
}

at::Tensor Source::read(const Assignment& a, c10::Device device, c10::ScalarType dtype, bool views) const {
  const auto mode = views ? storage::ReadMode::Auto : direct ? storage::ReadMode::Direct : storage::ReadMode::Copy;
  at::Tensor value;
  if (a.patch) {
    if (dtype == kPacked) throw Error(where + ": " + a.parameter->name + " is changed by its adapters, so it is never held packed");
    const auto as_float = [&](const convert::Expr& s) {
      return storage::load_tensor(map, map.at(s.source, s.shard), {.dtype = c10::kFloat, .mode = storage::ReadMode::Auto});
    };
    // Terms on checkpoint tensors the expression reads: fused into each as it is read (every
    // source in float32, so that the expression joins values of one dtype).
    const auto adapted = [&](const convert::Expr& s) {
      for (const auto& [key, terms] : a.patch->sources)
        if (key == s.source) return model::LoraTerms::fused(terms, as_float(s));
      return as_float(s);
    };
    value = a.patch->fused(a.expr->op == convert::Expr::Op::Source && a.patch->sources.empty()
                               ? as_float(*a.expr)
                               : convert::evaluate(*a.expr, map, storage::ReadMode::Auto,
                                                   a.patch->sources.empty() ? convert::SourceValue() : adapted))
                .to(dtype);
  } else if (a.expr->op == convert::Expr::Op::Source)
    value = storage::load_tensor(map, map.at(a.expr->source, a.expr->shard), {.dtype = dtype, .mode = mode});
  else if (dtype == kPacked)
    value = convert::evaluate_packed(*a.expr, map, mode);
  else
    value = convert::evaluate(*a.expr, map, mode).to(dtype);
  return device.is_cpu() ? value : value.to(device);
}

const storage::TensorInfo* Source::stored(const Assignment& a, c10::ScalarType dtype) const {
  if (a.expr->op != convert::Expr::Op::Source || a.patch) return nullptr;
  const auto& info = map.at(a.expr->source, a.expr->shard);
  if (storage::dtype_block(info.dtype) != 1) return dtype == kPacked ? &info : nullptr;  // else unpacked on reading
  return storage::scalar_type(map, info) == dtype ? &info : nullptr;
}

at::Tensor Source::convert(const Assignment& a, const at::Tensor& value, c10::Device device, c10::ScalarType dtype) const {
  if (value.scalar_type() == kPacked && dtype != kPacked) {
    at::Tensor out = at::empty(a.parameter->shape, at::TensorOptions().device(device).dtype(dtype));
    convert_into(a, value, out);
    return out;
  }
  if (value.scalar_type() != kPacked && dtype == kPacked) return read(a, device, kPacked, false);
  return value.to(device, dtype);
}

void Source::convert_into(const Assignment& a, const at::Tensor& value, at::Tensor& out) const {
  if (value.scalar_type() == kPacked && out.scalar_type() != kPacked)
    storage::dequantize_into(*a.block, value.contiguous(), out);
  else if (value.scalar_type() != kPacked && out.scalar_type() == kPacked)
    out.copy_(read(a, c10::kCPU, kPacked, false));
  else if (value.is_cpu() && !out.is_cpu() && value.scalar_type() != out.scalar_type() && value.is_contiguous() &&
           out.is_contiguous())
    storage::cast_into(value, out);
  else
    out.copy_(value);
}

void Source::read_into(const Assignment& a, at::Tensor& out) const {
  const Assignment* const one = &a;
  read_into({&one, 1}, {&out, 1});
}

void Source::read_into(std::span<const Assignment* const> parts, std::span<at::Tensor> outs,
                       storage::DeviceStaging* staging) const {
  std::vector<storage::DiskMap::Range> reads;
  std::vector<storage::DeviceStaging::Target> staged;
  for (size_t i = 0; i < parts.size(); ++i) {
    at::Tensor& out = outs[i];
    const storage::TensorInfo* info = stored(*parts[i], out.scalar_type());
    if (!info || !out.is_contiguous() || out.nbytes() != info->nbytes)
      out.copy_(read(*parts[i], c10::kCPU, out.scalar_type(), false));
    else if (!out.is_cpu())
      staged.push_back({info->file, info->offset, out});
    else
      reads.push_back({info->file, info->offset, {static_cast<std::byte*>(out.mutable_data_ptr()), info->nbytes}});
  }
  map.read_ranges(reads, {.direct = direct});
  if (staged.empty()) return;
  if (!staging) throw Error(where + ": reading weights onto " + staged.front().out.device().str() + " needs staging buffers");
  staging->read(map, staged, direct);
}

void synchronise(c10::Device device) {
  if (!device.is_cpu()) c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
}

void write_values(std::span<const std::pair<at::Tensor, at::Tensor>> writes) {
  std::unordered_map<c10::Device, std::vector<storage::DeviceStaging::HostCopy>> staged;
  std::unordered_set<c10::Device> devices;
  std::vector<at::Tensor> hosts;  // the values cast, alive until their copies are done
  for (const auto& [target, value] : writes) {
    devices.insert(target.device());
    // Page-locked host memory (a kept memfd's) the device copies from directly, at the bus's speed.
    const bool pinned = !target.is_cpu() && value.is_cpu() && value.scalar_type() == target.scalar_type() &&
                        value.is_pinned();
    if (target.is_cpu() || !value.is_cpu() || pinned || !target.is_contiguous() || value.sizes() != target.sizes()) {
      target.copy_(value, /*non_blocking=*/pinned);  // synchronised below
      continue;
    }
    const at::Tensor& host = hosts.emplace_back(value.to(target.scalar_type()).contiguous());
    staged[target.device()].push_back({{static_cast<const std::byte*>(host.const_data_ptr()), host.nbytes()}, target});
  }
  for (const auto& [device, copies] : staged)
    storage::DeviceStaging(device).copy(copies);  // its buffers are kept for the next one (a load's, say)
  for (const auto& device : devices) synchronise(device);
}

c10::Device torch_device(const config::Device& device) {
  if (device.is_disk()) throw Error("weights on disk are on no device");
  if (device.is_cpu()) return c10::Device(c10::kCPU);
  if (const auto& why = torch_cuda::missing(); !why.empty()) throw Error(device.str() + ": " + why);
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device.index));
}

std::shared_ptr<Source> make_source(storage::DiskMap map, std::vector<Assignment> assignments,
                                    const config::ModelConfig& config) {
  storage::DirectChoice direct;
  if (const auto forced = config.vram.direct_io) {
    direct = {*forced, *forced ? "O_DIRECT: direct_io = true" : "page cache: direct_io = false"};
  } else {
    uint64_t held = 0;
    if (config.vram.computation.device.is_cpu()) held += config.vram.limit.value_or(0);
    if (config.vram.onload.device.is_cpu()) held += config.vram.onload_limit.value_or(0);
    direct = storage::choose_direct_io(map.total_bytes(), held, storage::page_cache_room());
  }
  for (auto& a : assignments) a.block = a.patch ? std::nullopt : convert::packed_type(*a.expr, map);
  return std::make_shared<Source>(
      Source{std::move(map), std::move(assignments), config.path, direct.direct, std::move(direct.why)});
}

uint64_t direct_phase(uint64_t offset, c10::ScalarType dtype) {
  const uint64_t phase = offset % storage::File::kDirectAlignment;
  return phase % c10::elementSize(dtype) == 0 ? phase : 0;
}

namespace {

// The memory mapping under a CPU buffer of fresh_buffer's: unmapped with its tensor's storage.
struct Mapping {
  void* base;
  size_t length;
  ~Mapping() { munmap(base, length); }
};

void unmap_buffer(void* context) { delete static_cast<Mapping*>(context); }

size_t byte_count(c10::IntArrayRef shape, c10::ScalarType dtype) {
  return storage::element_count(shape) * c10::elementSize(dtype);
}

// Room for `nbytes` at any phase: a page more than they need.
size_t mapped_length(size_t nbytes) { return nbytes + storage::File::kDirectAlignment; }

// A tensor of `shape` and `dtype` beginning `phase` bytes into the mapping, which its storage
// owns. set_, not a view of a byte tensor: a view holds its base, and the storage would never be
// the buffer's alone (StreamedWeights reuses a buffer only where it is).
at::Tensor tensor_in(std::unique_ptr<Mapping> mapping, c10::IntArrayRef shape, c10::ScalarType dtype, uint64_t phase) {
  void* base = mapping->base;
  const size_t length = mapping->length;
  c10::Storage storage(c10::Storage::use_byte_size_t(), length,
                       c10::DataPtr(base, mapping.release(), &unmap_buffer, c10::Device(c10::kCPU)), nullptr, false);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, static_cast<int64_t>(phase / c10::elementSize(dtype)), shape);
}

[[noreturn]] void cannot_map(size_t length) {
  throw Error("cannot map " + format_bytes(length) + " for streamed weights: " + std::strerror(errno));
}

}  // namespace

at::Tensor fresh_buffer(c10::IntArrayRef shape, c10::ScalarType dtype, c10::Device device, uint64_t phase) {
  if (!device.is_cpu()) return at::empty(shape, at::TensorOptions().device(device).dtype(dtype));
  const size_t nbytes = byte_count(shape, dtype);
  if (nbytes == 0) return at::empty(shape, at::TensorOptions().dtype(dtype));
  const size_t length = mapped_length(nbytes);
  void* memory = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) cannot_map(length);
  madvise(memory, length, MADV_HUGEPAGE);
  return tensor_in(std::make_unique<Mapping>(memory, length), shape, dtype, phase);
}

at::Tensor refit_buffer(at::Tensor spare, c10::IntArrayRef shape, c10::ScalarType dtype, uint64_t phase) {
  const size_t nbytes = byte_count(shape, dtype);
  // Only the storage's one holder may take its mapping (a mutable DataPtr of a shared storage
  // would be a copy-on-write one's materialised).
  if (nbytes == 0 || spare.use_count() != 1 || spare.storage().use_count() != 1 ||
      !spare.storage().data_ptr().cast_context<Mapping>(&unmap_buffer)) {
    const c10::Device device = spare.device();
    spare = at::Tensor();  // freed before its replacement is allocated
    return fresh_buffer(shape, dtype, device, phase);
  }
  std::unique_ptr<Mapping> mapping(static_cast<Mapping*>(spare.storage().mutable_data_ptr().release_context()));
  spare = at::Tensor();  // its storage frees nothing now
  if (const size_t length = mapped_length(nbytes); length != mapping->length) {
    void* moved = mremap(mapping->base, mapping->length, length, MREMAP_MAYMOVE);
    if (moved == MAP_FAILED) cannot_map(length);  // the mapping is unmapped as it was
    mapping->base = moved, mapping->length = length;
  }
  return tensor_in(std::move(mapping), shape, dtype, phase);
}

}  // namespace vramd::weights
