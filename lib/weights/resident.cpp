#include "weights/resident.hpp"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

#include "convert/expr.hpp"
#include "model/load_options.hpp"
#include "weights/loaded_model.hpp"
#include "storage/device_staging.hpp"
#include "storage/disk_map.hpp"
#include "storage/tensor_io.hpp"
#include "util/format.hpp"
#include "weights/copy_key.hpp"
#include "weights/lease.hpp"
#include "weights/shared_region.hpp"
#include "weights/source.hpp"

namespace vramd::weights {

namespace {

// Where resident weights are while the model is awake: its computation state, or for a model
// that rests for its clients, host memory in the onload dtype.
config::DeviceState awake_state(const model::Model& model, const config::ModelConfig& config) {
  const auto dtype = storage::dtype_of(model.dtype());
  return config::rests_for_clients(config)
             ? config::DeviceState{config::Device::named("cpu"), config.vram.onload.dtype.value_or(dtype)}
             : config::DeviceState{config.vram.computation.device, dtype};
}

bool packed_awake(const config::ModelConfig& config) {
  return config::rests_for_clients(config) && packed_state(config.vram.onload, config);
}

// The checkpoint bytes a weight read as `held` is a view of, where read_all may view them: its
// stored bytes as they are, aligned for their type in the page-aligned mapping (view_or_copy).
const storage::TensorInfo* viewable(const Source& source, const Assignment& a, c10::ScalarType held) {
  const storage::TensorInfo* info = source.stored(a, held);
  return info && info->nbytes && info->offset % c10::elementSize(held) == 0 ? info : nullptr;
}

// A contiguous view of shared memory: made from_blob, without an allocator (a region, a memfd,
// a checkpoint's mapping).
bool shared_view(const at::Tensor& value) { return value.is_contiguous() && value.storage().allocator() == nullptr; }

// The identities of a checkpoint's files, as FileSpans names them, asked once each.
class FileNames {
 public:
  explicit FileNames(const storage::DiskMap& map) : map_(map) {}
  const std::string& operator()(uint32_t file) {
    auto [name, fresh] = names_.try_emplace(file);
    if (fresh) name->second = model::file_identity(map_.descriptor(file));
    return name->second;
  }

 private:
  const storage::DiskMap& map_;
  std::map<uint32_t, std::string> names_;
};

// The copies of checkpoint tensors resident weights hold in host memory, by their CopyKeys,
// process-wide: configs of one checkpoint loaded later take the copy of a weight they hold
// alike instead of reading their own (LoRA variants of one base, configs that differ in their
// limits or names). Held weakly: a copy lives while a weight holds it. A value about to be
// written in place is forgotten first, so that no later load takes the written bytes.
class SharedCopies {
 public:
  static SharedCopies& process() {
    static auto* copies = new SharedCopies;  // never destroyed: no weak pointer is let go after LibTorch's statics
    return *copies;
  }

  at::Tensor find(const std::string& key) {
    std::lock_guard lock(mutex_);
    const auto found = copies_.find(key);
    if (found == copies_.end()) return {};
    auto held = found->second.lock();
    return held ? at::Tensor(std::move(held)) : at::Tensor();
  }

  // Keeps `value` under `key`, unless a copy another load made meanwhile is kept there.
  void keep(const std::string& key, const at::Tensor& value) {
    std::lock_guard lock(mutex_);
    if (copies_.size() >= sweep_at_) {
      std::erase_if(copies_, [](const auto& copy) { return copy.second.expired(); });
      sweep_at_ = 2 * copies_.size() + 1024;
    }
    auto [kept, fresh] = copies_.try_emplace(key, value.getIntrusivePtr());
    if (!fresh && kept->second.expired()) kept->second = Weak(value.getIntrusivePtr());
  }

  // Of `values` (key, value), which are the copies kept under their keys.
  std::vector<bool> kept(const std::vector<std::pair<const std::string*, const at::Tensor*>>& values) {
    std::vector<bool> out(values.size());
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < values.size(); ++i) {
      const auto found = copies_.find(*values[i].first);
      out[i] = found != copies_.end() && !found->second.expired() &&
               found->second._unsafe_get_target() == values[i].second->unsafeGetTensorImpl();
    }
    return out;
  }

  void forget(const at::Tensor& value) {
    std::lock_guard lock(mutex_);
    std::erase_if(copies_, [&](const auto& copy) { return copy.second._unsafe_get_target() == value.unsafeGetTensorImpl(); });
  }

 private:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::mutex mutex_;
  std::unordered_map<std::string, Weak> copies_;
  size_t sweep_at_ = 1024;
};

// Whether a weight read as `held` on the host from `source` would be a copy that configs of its
// checkpoint can share: not a view of its pages (`views`: where read_all takes them) and not
// changed by a fused adapter of this config's.
bool shareable(const Source& source, const Assignment& a, c10::ScalarType held, bool views) {
  return !a.patch && !(views && viewable(source, a, held));
}

}  // namespace

model::FileSpans ResidentWeights::planned_views(const model::Model& model, const Source& source,
                                                const config::ModelConfig& config) {
  model::FileSpans spans;
  const config::DeviceState awake = awake_state(model, config);
  if (!awake.device.is_cpu()) return spans;
  const bool views = !source.direct;  // else read around the page cache, into copies
  FileNames files(source.map);
  CopyKeys keys(source.map);
  for (const auto& a : source.assignments) {
    const c10::ScalarType held = held_dtype(a, storage::scalar_type(*awake.dtype), packed_awake(config));
    if (shareable(source, a, held, views))
      spans.add(copy_span(keys(*a.expr, c10::toString(held), "cpu")), 0, held_bytes(a, held));
    else if (const auto* info = views ? viewable(source, a, held) : nullptr)
      spans.add(files(info->file), info->offset, info->offset + info->nbytes);
  }
  return spans;
}

ResidentWeights::ResidentWeights(model::Model& model, std::shared_ptr<Source> source, const config::ModelConfig& config,
                                 const model::LoadOptions& options, size_t& zero_copy)
    : model_(model),
      source_(std::move(source)),
      states_(config.vram),
      awake_(awake_state(model, config)),
      zero_copy_(options.zero_copy),
      packed_awake_(packed_awake(config)),
      packed_offload_(config::rests_for_clients(config) && packed_state(states_.offload, config)) {
  read_all(torch_device(awake_.device), storage::scalar_type(*awake_.dtype), packed_awake_, &options, &zero_copy);
  unmap_copied();
  for (const auto& layer : model.layers()) layer->set_manager(this);
}

ResidentWeights::~ResidentWeights() {
  for (const auto& layer : model_.layers()) layer->set_manager(nullptr);
}

std::vector<at::Tensor> ResidentWeights::acquire(const model::Layer& layer) { return layer.weights(); }

void ResidentWeights::release(const model::Layer&) {}

// Every assigned weight, in checkpoint order, straight into `device` and `dtype` (GGUF blocks
// kept as their packed bytes where `packed`). Returns the bytes read. On a GPU, weights are read
// in groups (Source::read_into): those the checkpoint holds as they are computed through pinned
// staging buffers with many reads in flight (storage::DeviceStaging), the rest through host
// memory; progress is told as each group is on the device.
uint64_t ResidentWeights::read_all(c10::Device device, c10::ScalarType dtype, bool packed,
                                   const model::LoadOptions* options, size_t* zero_copy) {
  constexpr uint64_t kGroupBytes = 512u << 20;
  model::Progress progress;
  progress.tensors_total = source_->assignments.size();
  for (const auto& a : source_->assignments) progress.bytes_total += held_bytes(a, held_dtype(a, dtype, packed));
  const bool views = zero_copy_ && device.is_cpu() && !source_->direct;  // views are read through the page cache
  const auto& map = source_->map;
  CopyKeys keys(map);
  copies_.clear();
  auto done = [&](const Assignment& a) {
    progress.bytes_done += a.parameter->value.nbytes();
    progress.tensors_done++;
    progress.tensor = a.parameter->name;
    const bool last = progress.tensors_done == progress.tensors_total;  // nothing left to cancel
    if (options && options->progress && !options->progress(progress) && !last) {
      for (const auto& b : source_->assignments) b.parameter->value = at::Tensor();
      throw model::Cancelled(source_->where + ": load cancelled after " + std::to_string(progress.tensors_done) + " of " +
                             counted(progress.tensors_total, "tensor"));
    }
  };
  std::optional<storage::DeviceStaging> staging;
  if (!device.is_cpu()) staging.emplace(device);
  std::vector<const Assignment*> group;
  std::vector<at::Tensor> outs;
  uint64_t group_bytes = 0;
  auto read_group = [&] {
    if (group.empty()) return;
    source_->read_into(group, outs, &*staging);
    synchronise(device);
    outs.clear(), group_bytes = 0;
    for (const Assignment* a : std::exchange(group, {})) done(*a);
  };
  for (const auto& a : source_->assignments) {
    const c10::ScalarType held = held_dtype(a, dtype, packed);
    if (staging) {
      a.parameter->value = at::empty(held_shape(a, held), at::TensorOptions().device(device).dtype(held));
      group.push_back(&a);
      outs.push_back(a.parameter->value);
      if ((group_bytes += a.parameter->value.nbytes()) >= kGroupBytes) read_group();
      continue;
    }
    std::string key;
    if (device.is_cpu() && shareable(*source_, a, held, views)) {
      key = keys(*a.expr, c10::toString(held), "cpu");
      if (at::Tensor copy = SharedCopies::process().find(key); copy.defined()) {
        a.parameter->value = std::move(copy);
        copies_.push_back({&a, std::move(key)});
        done(a);
        continue;
      }
    }
    const at::Tensor value = source_->read(a, device, held, views);
    if (!key.empty() && !shared_view(value)) {
      SharedCopies::process().keep(key, value);
      copies_.push_back({&a, std::move(key)});
    }
    if (zero_copy && views && a.expr->op == convert::Expr::Op::Source &&
        value.const_data_ptr() == map.bytes(map.at(a.expr->source, a.expr->shard)).first.data())
      ++*zero_copy;
    a.parameter->value = value;
    done(a);
  }
  read_group();
  return progress.bytes_done;
}

// Every weight to `state` (GGUF blocks kept packed where `packed`); "auto" keeps each weight's
// dtype, and unpacks packed bytes into the awake one. Returns the bytes moved or read.
uint64_t ResidentWeights::move_to(const config::DeviceState& state, bool packed) {
  const auto& assignments = source_->assignments;
  const bool released = std::any_of(assignments.begin(), assignments.end(),
                                    [](const Assignment& a) { return a.parameter->value.is_meta(); });
  const auto unpacked = [&](const at::Tensor& value) {
    return value.scalar_type() == kPacked ? storage::scalar_type(*awake_.dtype) : value.scalar_type();
  };
  uint64_t bytes = 0;
  if (state.device.is_disk()) {
    for (const auto& a : assignments) {
      at::Tensor& value = a.parameter->value;
      if (value.is_meta()) continue;
      bytes += value.nbytes();
      value = updated_.count(a.parameter)
                  ? value.to(c10::kCPU)  // in no checkpoint: kept on the host
                  : at::empty(a.parameter->shape, at::TensorOptions().device(c10::kMeta).dtype(unpacked(value)));
    }
    return bytes;
  }
  const c10::Device device = torch_device(state.device);
  if (released) {
    std::vector<std::pair<model::Parameter*, at::Tensor>> kept;
    for (const auto& a : assignments)
      if (updated_.count(a.parameter)) kept.emplace_back(a.parameter, a.parameter->value);
    const auto dtype = state_dtype(state.dtype, assignments.front().parameter->value.scalar_type());
    bytes = read_all(device, dtype, packed, nullptr, nullptr);
    for (auto& [parameter, value] : kept) parameter->value = value.to(device, dtype);
    return bytes;
  }
  for (const auto& a : assignments) {
    at::Tensor& value = a.parameter->value;
    // An updated weight is in no checkpoint, which packed bytes would be read from again.
    const auto held = held_dtype(a, state_dtype(state.dtype, unpacked(value)), packed && !updated_.count(a.parameter));
    if (value.device() == device && value.scalar_type() == held) continue;
    value = source_->convert(a, value, device, held);
    bytes += value.nbytes();
  }
  return bytes;
}

uint64_t ResidentWeights::sleep() {
  const uint64_t moved = move_to(states_.offload, packed_offload_);
  unmap_copied();
  return moved;
}

uint64_t ResidentWeights::wake() {
  const uint64_t moved = move_to(awake_, packed_awake_);
  unmap_copied();
  return moved;
}

void ResidentWeights::unmap_copied() const {
  std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> keep;
  for (const auto* parameter : model_.parameters()) {
    const at::Tensor& value = parameter->value;
    if (!value.defined() || !value.is_cpu()) continue;
    const auto& storage = value.storage();
    if (const auto found = source_->map.locate(storage.data(), storage.nbytes()))
      keep[found->first].emplace_back(found->second, found->second + storage.nbytes());
  }
  source_->map.unmap_pages_except(std::move(keep));
}

std::optional<model::VramStats> ResidentWeights::stats() const { return std::nullopt; }

model::FileSpans ResidentWeights::views() const {
  model::FileSpans spans;
  FileNames files(source_->map);
  for (const auto& a : source_->assignments) {
    const at::Tensor& value = a.parameter->value;
    if (!value.defined() || !value.is_cpu() || !shared_view(value)) continue;  // a copy
    const auto found = source_->map.locate(value.const_data_ptr(), value.nbytes());
    if (!found) continue;  // a view of other shared memory (a lease's region, an update's memfd)
    spans.add(files(found->first), found->second, found->second + value.nbytes());
  }
  std::vector<std::pair<const std::string*, const at::Tensor*>> copies;
  for (const auto& copy : copies_) copies.emplace_back(&copy.key, &copy.assignment->parameter->value);
  const std::vector<bool> kept = SharedCopies::process().kept(copies);
  for (size_t i = 0; i < copies.size(); ++i)
    if (kept[i]) spans.add(copies_[i].span, 0, copies[i].second->nbytes());
  return spans;
}

std::map<std::string, uint64_t> ResidentWeights::bytes_by_device() const {
  std::map<std::string, uint64_t> bytes;
  for (const auto* parameter : model_.parameters()) {
    const at::Tensor& value = parameter->value;
    if (parameter->tied || !value.defined() || value.is_meta()) continue;
    bytes[value.device().str()] += value.nbytes();
  }
  return bytes;
}

namespace {

// Memory an allocator gave the daemon for this value alone: not a view of a checkpoint's mapping
// or of a lease's region (made from_blob, without an allocator), and held by nothing else.
bool own_alone(const at::Tensor& value) {
  return value.use_count() == 1 && value.storage().allocator() != nullptr && value.storage().use_count() == 1 &&
         value.is_contiguous();
}

// A value in GPU memory that a lease shares (a cuda::VmmRegion): WeightUpdate::shared_in_place
// writes it where it is.
bool in_gpu_region(const at::Tensor& value) { return !value.is_cpu() && shared_view(value); }

// A value that a weight may keep as it is (WeightUpdate::adopt): a view of shared memory laid
// out as the weight is held and where it is held.
bool adoptable(const at::Tensor& now, const at::Tensor& value) {
  return value.device() == now.device() && value.scalar_type() == now.scalar_type() && shared_view(value);
}

}  // namespace

void ResidentWeights::update(const std::string& model, const WeightUpdate& update) {
  const auto& values = update.values;
  for (const auto& [parameter, value] : values) {
    if (parameter->value.scalar_type() == kPacked) throw packed_not_updatable(model, parameter->name);
    if (!at::isFloatingType(parameter->value.scalar_type()))  // held as it is: values would be cast into it
      throw NotUpdatable("model " + quote(model) + " holds " + quote(parameter->name) + " as " +
                         std::string(c10::toString(parameter->value.scalar_type())) +
                         " values as the checkpoint has them, which take no update; only floating-point weights do");
  }
  if (update.adopt && std::all_of(values.begin(), values.end(),
                                  [](const auto& v) { return adoptable(v.first->value, v.second); })) {
    if (update.check) update.check();
    for (const auto& [parameter, value] : values) {
      replaced_.push_back(std::exchange(parameter->value, value));
      updated_.insert(parameter);
    }
    return;
  }
  // Each where its parameter's value is now (an offloaded model is woken first): fresh memory
  // for all first, then the swap. A value written in place whose bytes may change while read is
  // copied into host memory first, and written only once `check` has passed.
  std::vector<bool> beside(values.size());
  std::vector<at::Tensor> sources(values.size());
  std::map<std::string, uint64_t> room;
  for (size_t i = 0; i < values.size(); ++i) {
    const at::Tensor& now = values[i].first->value;
    const bool in_region = update.shared_in_place && in_gpu_region(now);
    beside[i] = !(in_region || (update.in_place && own_alone(now)));
    if (beside[i]) room[now.device().str()] += now.nbytes();
    sources[i] = beside[i] || update.in_place ? values[i].second : values[i].second.clone();
  }
  for (const auto& [device, bytes] : room) {
    const auto held = update.room.find(device);
    if (held == update.room.end() || held->second < bytes) throw UpdateNeedsRoom(room);
  }
  // Host values beside the old ones in one new region, where the model is leased on the host
  // (WeightUpdate::shared): written through its writable mapping, computed with through the
  // read-only one once it is sealed.
  std::vector<uint64_t> offsets(values.size());
  uint64_t packed = 0;
  for (size_t i = 0; i < values.size(); ++i)
    if (update.shared && beside[i] && values[i].first->value.is_cpu())
      offsets[i] = std::exchange(packed, packed + region_aligned(values[i].first->value.nbytes()));
  const auto region = packed ? SharedRegion::create(packed, "vramd:" + model) : nullptr;
  const auto in_region = [&](size_t i) { return region && beside[i] && values[i].first->value.is_cpu(); };
  std::vector<at::Tensor> fresh(values.size());
  std::vector<std::pair<at::Tensor, at::Tensor>> writes;
  for (size_t i = 0; i < values.size(); ++i) {
    const at::Tensor& now = values[i].first->value;
    if (in_region(i))
      writes.emplace_back(fresh[i] = at::from_blob(region->writable() + offsets[i], now.sizes(), now.options()), sources[i]);
    else if (beside[i])
      writes.emplace_back(fresh[i] = at::empty(now.sizes(), now.options()), sources[i]);
  }
  write_values(writes);
  if (update.check) update.check();
  writes.clear();
  if (region) {
    region->seal();
    for (size_t i = 0; i < values.size(); ++i)
      if (in_region(i))
        fresh[i] = at::from_blob(const_cast<std::byte*>(region->data() + offsets[i]), fresh[i].sizes(), [region](void*) {},
                                 fresh[i].options());
  }
  for (size_t i = 0; i < values.size(); ++i) {
    at::Tensor& now = values[i].first->value;
    if (fresh[i].defined()) {
      replaced_.push_back(std::exchange(now, std::move(fresh[i])));
    } else {
      SharedCopies::process().forget(now);  // no config loaded later takes the new values for the checkpoint's
      writes.emplace_back(now, sources[i]);
    }
    updated_.insert(values[i].first);
  }
  write_values(writes);
  if (region) update.shared(region);
}

std::shared_ptr<void> ResidentWeights::take_replaced(std::map<std::string, uint64_t>& bytes) {
  if (replaced_.empty()) return {};
  // At most what dropping them frees: each value whose storage nothing else in the daemon
  // holds (a view of a mapping or a region counts, though the pages may stay with the others;
  // a copy another config shares does not).
  for (const auto& value : replaced_)
    if (value.use_count() == 1 && value.storage().use_count() == 1) bytes[value.device().str()] += value.nbytes();
  return std::make_shared<std::vector<at::Tensor>>(std::exchange(replaced_, {}));
}

void ResidentWeights::check_leasable(const std::string& model, const std::string& device) const {
  for (const auto* p : model_.parameters()) {
    const at::Tensor& value = p->tied ? p->tied->value : p->value;
    if (!value.defined() || value.is_meta()) continue;
    if (value.device().str() != device && awake_.device != states_.computation.device)
      throw NotLeasable("model " + quote(model) + " rests in host memory for the clients that manage it (architecture "
                        "\"weights\" with a [vram] table), and computes nowhere in the daemon: lease it on cpu");
    if (value.device().str() != device)
      throw NotLeasable("model " + quote(model) + " holds its weights on " + value.device().str() + ", not on " + device +
                        "; a lease hands over the weights the model computes with: lease it on " +
                        value.device().str() + ", or set [vram].computation.device = " + quote(device) +
                        " in its config to lease it there");
  }
}

}  // namespace vramd::weights
