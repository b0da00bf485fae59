#include <ATen/ops/from_blob.h>

#include <cstring>
#include <map>

#include "convert/expr.hpp"
#include "model/loader.hpp"
#include "storage/tensor_io.hpp"
#include "util/format.hpp"
#include "weights/lease.hpp"
#include "weights/source.hpp"
#include "weights/weights.hpp"

namespace vramd::weights {
namespace {

constexpr uint64_t kAlignment = 64;  // of each weight packed into a region

uint64_t align_up(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

// The bytes a strided tensor spans from its first element.
uint64_t extent(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return static_cast<uint64_t>(last + 1) * t.element_size();
}

// The value a parameter computes with (a tied one's is its leader's); undefined when it has none.
const at::Tensor& value_of(const model::Parameter& p) { return p.tied ? p.tied->value : p.value; }

}  // namespace

Manifest LeaseMemory::share(model::LoadedModel& loaded, const std::string& name) {
  loaded.weights->check_leasable(name);
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
  std::vector<model::Parameter*> to_pack;
  uint64_t pack_bytes = 0;
  for (auto* p : loaded.model->parameters()) {
    if (p->tied || !p->value.defined() || p->value.is_meta() || p->value.numel() == 0 || locate(p->value)) continue;
    to_pack.push_back(p);
    pack_bytes += align_up(p->value.nbytes());
  }
  if (!to_pack.empty()) {
    auto region = SharedRegion::create(pack_bytes, "vramd:" + name);
    uint64_t at = 0;
    std::vector<uint64_t> offsets;
    for (auto* p : to_pack) {
      const at::Tensor source = p->value.contiguous();
      std::memcpy(region->writable() + at, source.const_data_ptr(), source.nbytes());
      offsets.push_back(at);
      at += align_up(source.nbytes());
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
  const auto region_of = [&](const Place& place) {
    const auto [it, added] = index.emplace(std::pair{place.region.has_value(), place.region.value_or(*place.file)},
                                           manifest.regions.size());
    if (!added) return it->second;
    if (place.region) {
      const auto& region = *regions[*place.region];
      manifest.regions.push_back({"memfd", "", region.size(), UniqueFd::duplicate(region.fd(), "model " + quote(name))});
    } else {
      const auto& file = map.files()[*place.file];
      manifest.regions.push_back({"file", file.path, file.size, UniqueFd::duplicate(map.descriptor(*place.file), file.path)});
    }
    return it->second;
  };
  for (const auto* p : loaded.model->parameters()) {
    const at::Tensor& value = value_of(*p);
    if (!value.defined() || value.is_meta()) continue;  // missing from the checkpoint (strict = false)
    LeaseTensor tensor{p->name, convert::dtype_torch_name(storage::dtype_of(value.scalar_type())),
                       std::vector<int64_t>(value.sizes().begin(), value.sizes().end()),
                       std::vector<int64_t>(value.strides().begin(), value.strides().end()), std::nullopt, 0};
    if (!p->tied) manifest.bytes += value.nbytes();
    if (value.numel() > 0) {
      const auto place = locate(value);
      if (!place) throw Error("model " + quote(name) + ": weight " + quote(p->name) + " is not in shareable memory");
      tensor.region = region_of(*place);
      tensor.offset = place->offset;
    }
    manifest.tensors.push_back(std::move(tensor));
  }
  return manifest;
}

}  // namespace vramd::weights
