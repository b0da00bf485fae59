#include <ATen/DeviceAccelerator.h>
#include <ATen/ops/from_blob.h>

#include <cstring>
#include <map>

#include "convert/expr.hpp"
#include "weights/loaded_model.hpp"
#include "storage/tensor_io.hpp"
#include "util/format.hpp"
#include "weights/lease.hpp"
#include "weights/source.hpp"
#include "weights/weights.hpp"

namespace vramd::weights {
namespace {

// The bytes a strided tensor spans from its first element.
uint64_t extent(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return static_cast<uint64_t>(last + 1) * t.element_size();
}

// The value a parameter computes with (a tied one's is its leader's); undefined when it has none.
const at::Tensor& value_of(const model::Parameter& p) { return p.tied ? p.tied->value : p.value; }

// A weight's region (an index into the manifest's regions) and its offset in bytes there.
using Placement = std::pair<size_t, uint64_t>;

// The weights `placed` finds no place for (tied ones and those without elements aside), and
// their bytes packed at kRegionAlignment.
template <typename Placed>
std::pair<std::vector<model::Parameter*>, uint64_t> unplaced(const weights::LoadedModel& loaded, const Placed& placed) {
  std::vector<model::Parameter*> params;
  uint64_t bytes = 0;
  for (auto* p : loaded.model->parameters()) {
    if (p->tied || !p->value.defined() || p->value.is_meta() || p->value.numel() == 0 || placed(p->value)) continue;
    params.push_back(p);
    bytes += region_aligned(p->value.nbytes());
  }
  return {std::move(params), bytes};
}

// Every weight of `loaded` into manifest.tensors, each put where `place` says (tied ones counted
// once in manifest.bytes).
template <typename Place>
void describe(const weights::LoadedModel& loaded, const std::string& name, Manifest& manifest, const Place& place) {
  std::map<const model::Parameter*, storage::DType> blocks;  // of the weights held packed
  if (loaded.source)
    for (const auto& a : loaded.source->assignments)
      if (a.block) blocks.emplace(a.parameter, *a.block);
  for (const auto* p : loaded.model->parameters()) {
    const at::Tensor& value = value_of(*p);
    if (!value.defined() || value.is_meta()) continue;  // missing from the checkpoint (strict = false)
    LeaseTensor tensor{p->name, convert::dtype_torch_name(storage::dtype_of(value.scalar_type())),
                       std::vector<int64_t>(value.sizes().begin(), value.sizes().end()),
                       std::vector<int64_t>(value.strides().begin(), value.strides().end()), std::nullopt, 0, {}, {}};
    const auto block = blocks.find(p->tied ? p->tied : p);
    if (value.scalar_type() == kPacked && block != blocks.end()) {
      tensor.packed = storage::dtype_name(block->second);
      tensor.unpacked_shape = p->shape;
    }
    if (!p->tied) manifest.bytes += value.nbytes();
    if (value.numel() > 0) {
      const std::optional<Placement> placement = place(value);
      if (!placement) throw Error("model " + quote(name) + ": weight " + quote(p->name) + " is not in shareable memory");
      tensor.region = placement->first;
      tensor.offset = placement->second;
    }
    manifest.tensors.push_back(std::move(tensor));
  }
}

}  // namespace

Manifest LeaseMemory::share(weights::LoadedModel& loaded, const std::string& name, const config::Device& device) {
  loaded.weights->check_leasable(name, device.str());
  if (!device.is_cpu()) return share_cuda(loaded, name, device);
  leased_on_host_ = true;
  const auto& map = loaded.source->map;
  std::vector<std::shared_ptr<SharedRegion>> regions;
  for (const auto& weak : regions_)
    if (auto region = weak.lock()) regions.push_back(std::move(region));

  struct Place {
    std::optional<size_t> region;  // into `regions`
    std::optional<uint32_t> file;  // of the checkpoint
    uint64_t offset = 0;
  };
  const auto locate = [&](const at::Tensor& value) -> std::optional<Place> {
    const auto* p = static_cast<const std::byte*>(value.const_data_ptr());
    const uint64_t n = extent(value);
    for (size_t i = 0; i < regions.size(); ++i)
      if (regions[i]->contains(p) && p + n <= regions[i]->data() + regions[i]->size())
        return Place{i, std::nullopt, static_cast<uint64_t>(p - regions[i]->data())};
    if (auto found = map.locate(p, n)) return Place{std::nullopt, found->first, found->second};
    return std::nullopt;
  };

  // Weights in memory of the daemon's own go into one new region, packed contiguously.
  const auto [to_pack, pack_bytes] = unplaced(loaded, locate);
  if (!to_pack.empty()) {
    auto region = SharedRegion::create(pack_bytes, "vramd:" + name);
    uint64_t at = 0;
    std::vector<uint64_t> offsets;
    for (auto* p : to_pack) {
      const at::Tensor source = p->value.contiguous();
      std::memcpy(region->writable() + at, source.const_data_ptr(), source.nbytes());
      offsets.push_back(at);
      at += region_aligned(source.nbytes());
    }
    region->seal();
    for (size_t i = 0; i < to_pack.size(); ++i) {
      auto* p = to_pack[i];
      void* data = const_cast<std::byte*>(region->data() + offsets[i]);
      p->value = at::from_blob(data, p->value.sizes(), [region](void*) {}, p->value.options());
    }
    regions.push_back(region);
    regions_.push_back(region);
  }

  Manifest manifest;
  // A region of ours or a checkpoint file -> its index in manifest.regions, added when first used.
  std::map<std::pair<bool, size_t>, size_t> index;
  describe(loaded, name, manifest, [&](const at::Tensor& value) -> std::optional<Placement> {
    const auto place = locate(value);
    if (!place) return std::nullopt;
    const auto [it, added] = index.emplace(std::pair{place->region.has_value(), place->region.value_or(*place->file)},
                                           manifest.regions.size());
    if (added && place->region) {
      const auto& region = *regions[*place->region];
      manifest.regions.push_back({"memfd", "", region.size(), UniqueFd::duplicate(region.fd(), "model " + quote(name))});
    } else if (added) {
      const auto& file = map.files()[*place->file];
      manifest.regions.push_back({"file", file.path, file.size, UniqueFd::duplicate(map.descriptor(*place->file), file.path)});
    }
    return Placement{it->second, place->offset};
  });
  return manifest;
}

void LeaseMemory::adopt(const std::shared_ptr<SharedRegion>& region) {
  std::erase_if(regions_, [](const auto& weak) { return weak.expired(); });  // one memfd an update: drop the freed
  regions_.push_back(region);
}

ManagedPlan managed_plan(const model::Model& model, const Source& source, const config::ModelConfig& config) {
  const c10::ScalarType dtype = state_dtype(config.vram.computation.dtype, model.dtype());
  ManagedPlan plan{config.vram.computation.device.str(), convert::dtype_torch_name(storage::dtype_of(dtype)),
                   config.vram.limit, {}};
  std::map<const model::Parameter*, uint64_t> computed;  // in the computation dtype, an integer in its own
  std::map<const model::Parameter*, uint64_t> resting;   // as the onload state holds it, for a model not loaded
  const c10::ScalarType onload = state_dtype(config.vram.onload.dtype, model.dtype());
  const bool packed = packed_state(config.vram.onload, config);
  for (const auto& a : source.assignments) {
    computed[a.parameter] = held_bytes(a, held_dtype(a, dtype, /*packed=*/false));
    resting[a.parameter] = held_bytes(a, held_dtype(a, onload, packed));
  }
  for (const auto& layer : model.layers()) {
    ManagedUnit unit{layer->path(), {}, 0, 0};
    for (const auto& p : layer->parameters()) {
      unit.tensors.push_back(p.name);
      if (p.tied || !p.value.defined()) continue;
      const auto held = resting.find(&p);
      unit.resting += p.value.is_meta() && held != resting.end() ? held->second : p.value.nbytes();
      const auto bytes = computed.find(&p);
      unit.computed += bytes != computed.end() ? bytes->second : static_cast<uint64_t>(p.elements()) * c10::elementSize(dtype);
    }
    plan.units.push_back(std::move(unit));
  }
  return plan;
}

Manifest LeaseMemory::share_cuda(weights::LoadedModel& loaded, const std::string& name, const config::Device& device) {
  std::vector<std::shared_ptr<cuda::VmmRegion>> regions;
  for (const auto& weak : cuda_regions_)
    if (auto region = weak.lock()) regions.push_back(std::move(region));
  const auto locate = [&](const at::Tensor& value) -> std::optional<Placement> {
    const auto* p = static_cast<const std::byte*>(value.const_data_ptr());
    for (size_t i = 0; i < regions.size(); ++i)
      if (regions[i]->contains(p) && p + extent(value) <= regions[i]->data() + regions[i]->size())
        return Placement{i, static_cast<uint64_t>(p - regions[i]->data())};
    return std::nullopt;
  };

  // Weights in the caching allocator's memory move into one new exportable allocation.
  const auto [to_pack, pack_bytes] = unplaced(loaded, locate);
  if (!to_pack.empty()) {
    std::shared_ptr<cuda::VmmRegion> region;
    try {
      region = cuda::VmmRegion::create(device.index, pack_bytes);
    } catch (const Error& e) {
      throw NotLeasable("model " + quote(name) + ": cannot share its weights on " + device.str() + ": " + e.what());
    }
    uint64_t at = 0;
    for (auto* p : to_pack) {
      at::Tensor placed = at::for_blob(region->data() + at, p->value.sizes())
                              .deleter([region](void*) {})
                              .options(p->value.options())
                              .target_device(p->value.device())
                              .make_tensor();
      placed.copy_(p->value);
      at += region_aligned(p->value.nbytes());
      p->value = std::move(placed);
    }
    at::accelerator::synchronizeDevice(static_cast<c10::DeviceIndex>(device.index));  // in place before a client reads
    at::accelerator::emptyCache();  // the weights' former memory back to the driver
    regions.push_back(region);
    cuda_regions_.push_back(region);
  }

  Manifest manifest;
  manifest.device = device.str();
  std::map<size_t, size_t> index;  // regions[i] -> its index in manifest.regions
  describe(loaded, name, manifest, [&](const at::Tensor& value) -> std::optional<Placement> {
    const auto place = locate(value);
    if (!place) return std::nullopt;
    const auto [it, added] = index.emplace(place->first, manifest.regions.size());
    if (added) {
      const auto& region = *regions[place->first];
      manifest.regions.push_back({"cuda", "", region.size(), UniqueFd::duplicate(region.fd(), "model " + quote(name))});
    }
    return Placement{it->second, place->second};
  });
  return manifest;
}

}  // namespace vramd::weights
