#include "weights/streamed.hpp"
#include "weights/streamed_slot.hpp"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#include "model/model.hpp"
#include "storage/file.hpp"
#include "storage/tensor_io.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "weights/holdings.hpp"
#include "weights/lease.hpp"
#include "weights/plan.hpp"
#include "weights/source.hpp"

namespace vramd::weights {

using model::Layer;
using model::Parameter;
using model::VramStats;

namespace {

using Clock = std::chrono::steady_clock;

static_assert(kHostStagingBytes == storage::DeviceStaging::kBuffers * storage::DeviceStaging::kBufferBytes,
              "the budget charges a streamed model's staging buffers at DeviceStaging's size");

std::string dtype_text(c10::ScalarType type) { return storage::torch_name(type); }

// The preparing state's dtype as the plan's errors name it.
std::string prepared_text(c10::ScalarType prepared, std::span<const SlotBytes> slots) {
  const bool packed = std::any_of(slots.begin(), slots.end(), [](const SlotBytes& slot) { return slot.packed; });
  return dtype_text(prepared) + (packed ? " and packed GGUF blocks" : "");
}

}  // namespace

namespace {

// Each layer's parameters' assignments (a tied one: its leader's); null where none was loaded.
std::vector<std::vector<const Assignment*>> layer_parts(const model::Model& model, const Source& source) {
  std::map<const Parameter*, const Assignment*> by_parameter;
  for (const auto& a : source.assignments) by_parameter[a.parameter] = &a;
  std::vector<std::vector<const Assignment*>> layers;
  for (const auto& layer : model.layers()) {
    auto& parts = layers.emplace_back();
    for (const auto& parameter : layer->parameters()) {
      auto it = by_parameter.find(parameter.tied ? parameter.tied : &parameter);
      parts.push_back(it == by_parameter.end() ? nullptr : it->second);
    }
  }
  return layers;
}

// A parameter's bytes held in `dtype` by a state that keeps GGUF blocks `packed`.
uint64_t bytes_held(const Parameter& parameter, const Assignment* part, c10::ScalarType dtype, bool packed) {
  if (!part) return static_cast<uint64_t>(parameter.elements()) * c10::elementSize(dtype);
  return held_bytes(*part, held_dtype(*part, dtype, packed));
}

// Each layer's bytes (its tied parameters too) in the states the plan counts.
std::vector<SlotBytes> slot_bytes(const model::Model& model, const Source& source, const config::ModelConfig& config) {
  const c10::ScalarType dtype = model.dtype(), prepared = state_dtype(config.vram.preparing.dtype, dtype);
  const c10::ScalarType onload = state_dtype(config.vram.onload.dtype, dtype);
  const bool packed = packed_state(config.vram.preparing, config), onload_packed = packed_state(config.vram.onload, config);
  const auto parts = layer_parts(model, source);
  const bool routed = std::any_of(model.layers().begin(), model.layers().end(), [](auto& l) { return l->routed(); });
  if (config.vram.experts_on_cpu && !routed)
    fail(config::where(config, "vram.experts"), "vram.experts = \"cpu\", but " + quote(model.architecture()) + " has no experts to compute there");
  std::vector<SlotBytes> slots;
  for (size_t l = 0; l < model.layers().size(); ++l) {
    SlotBytes slot;
    slot.routed = model.layers()[l]->routed();
    const auto parameters = model.layers()[l]->parameters();
    if (slot.routed && config.vram.experts_on_cpu) {  // held unpacked in host memory, computed there
      slot.host = true;
      for (const auto& parameter : parameters) slot.prepared += static_cast<uint64_t>(parameter.elements()) * c10::elementSize(dtype);
      slot.onload = slot.prepared;
      slots.push_back(slot);
      continue;
    }
    for (size_t i = 0; i < parameters.size(); ++i) {
      const Assignment* part = parts[l][i];
      const uint64_t bytes = bytes_held(parameters[i], part, prepared, packed);
      const bool kept_packed = part && held_dtype(*part, prepared, packed) == kPacked;
      slot.prepared += bytes;
      slot.packed += kept_packed ? bytes : 0;
      if (kept_packed || prepared != dtype) slot.copy += static_cast<uint64_t>(parameters[i].elements()) * c10::elementSize(dtype);
      slot.onload += bytes_held(parameters[i], part, onload, onload_packed);
    }
    slots.push_back(slot);
  }
  return slots;
}

}  // namespace

VramStats StreamedWeights::plan(const model::Model& model, const Source& source, const config::ModelConfig& config) {
  const c10::ScalarType dtype = model.dtype(), prepared = state_dtype(config.vram.preparing.dtype, dtype);
  const auto sizes = slot_bytes(model, source, config);
  VramStats stats = plan_streaming(sizes, config, prepared_text(prepared, sizes), dtype_text(dtype)).stats;
  stats.plan = describe(stats, config, prepared, dtype, source.direct_why);
  return stats;
}

StreamedWeights::StreamedWeights(model::Model& model, std::shared_ptr<Source> source, const config::ModelConfig& config)
    : model_(model), source_(std::move(source)), config_(config), device_(torch_device(config.vram.computation.device)),
      dtype_(model.dtype()), prepared_dtype_(state_dtype(config.vram.preparing.dtype, model.dtype())),
      limit_(config.vram.limit.value_or(UINT64_MAX)), pool_(device_.is_cpu()),
      onload_packed_(packed_state(config.vram.onload, config)), offload_packed_(packed_state(config.vram.offload, config)) {
  if (!device_.is_cpu()) staging_ = std::make_unique<storage::DeviceStaging>(device_);
  const bool packed = packed_state(config.vram.preparing, config);
  auto parts = layer_parts(model, *source_);
  for (size_t l = 0; l < model.layers().size(); ++l) {
    auto slot = std::make_unique<Slot>();
    slot->layer = model.layers()[l].get();
    slot->routed = slot->layer->routed();
    by_layer_[slot->layer] = slot.get();
    slot->parts = std::move(parts[l]);
    for (const Assignment* part : slot->parts)
      slot->forms.push_back(part ? held_dtype(*part, prepared_dtype_, packed) : prepared_dtype_);
    slots_.push_back(std::move(slot));
  }
  std::vector<Slot*> layer_order;
  for (const auto& slot : slots_) layer_order.push_back(slot.get());
  order_ = LearnedOrder<Slot>(std::move(layer_order));

  const auto sizes = slot_bytes(model, *source_, config);
  const StreamPlan plan = plan_streaming(sizes, config, prepared_text(prepared_dtype_, sizes), dtype_text(dtype_));
  for (size_t i = 0; i < slots_.size(); ++i) {
    slots_[i]->bytes = sizes[i].prepared;
    slots_[i]->copy = sizes[i].copy;
    slots_[i]->resident = plan.resident[i];
    slots_[i]->from_disk = plan.from_disk[i];
    slots_[i]->host = sizes[i].host;
  }
  stats_ = plan.stats;
  onload_on_disk_ = config.vram.onload.device.is_disk();
  materialise_plan();
  prefetcher_ = std::thread([this] { prefetch_loop(); });
  for (const auto& layer : model.layers()) layer->set_manager(this);
}

StreamedWeights::~StreamedWeights() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  prefetcher_.join();
  for (const auto& layer : model_.layers()) layer->set_manager(nullptr);
}

// Where a buffer for the slot's parameter `i` should begin within a page: direct_phase of its
// offset in the checkpoint, when it is read there as stored with O_DIRECT (so the reads go
// straight into it); else 0.
uint64_t StreamedWeights::phase(const Slot& slot, size_t i) const {
  if (!source_->direct || !slot.parts[i]) return 0;
  const storage::TensorInfo* info = source_->stored(*slot.parts[i], slot.forms[i]);
  return info ? direct_phase(info->offset, slot.forms[i]) : 0;
}

// The slot's weights on the computation device as the preparing state holds them (slot.forms),
// read into `buffers` where given (the rest freshly allocated). The reads of all of them are in
// flight together: on the CPU straight into the buffers, on CUDA through the pinned staging
// buffers, each chunk copied on the calling thread's current stream as it lands, then waited
// for. Weights stored otherwise (a converter's expression, another dtype) are read into host
// memory and copied from there. Weights held packed in the onload state and unpacked when
// prepared are unpacked here, on the computation device.
std::vector<at::Tensor> StreamedWeights::prepare(const Slot& slot, std::vector<at::Tensor> buffers) const {
  buffers.resize(slot.parts.size());
  const auto parameters = slot.layer->parameters();
  std::vector<const Assignment*> reads;
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < slot.parts.size(); ++i) {
    const Assignment* part = slot.parts[i];
    if (!part)
      throw Error("layer " + quote(slot.layer->path()) + ": parameter " + quote(parameters[i].name) + " was never loaded");
    at::Tensor& out = buffers[i];
    const c10::ScalarType form = slot.forms[i];
    if (!slot.held.empty()) {
      const at::Tensor& held = slot.held[i];
      if (out.defined() || device_.is_cpu() || held.scalar_type() != form)
        out = buffer(std::move(out), held_shape(*part, form), form);
      if (out.defined()) source_->convert_into(*part, held, out);
      else out = held.to(device_, form, /*non_blocking=*/held.is_pinned());
    } else if (at::Tensor view = device_.is_cpu() ? mapped(slot, i) : at::Tensor(); view.defined()) {
      out = std::move(view);  // the buffer it replaces, if any, is freed
    } else {
      out = buffer(std::move(out), held_shape(*part, form), form, phase(slot, i));
      reads.push_back(part);
      outs.push_back(out);
    }
  }
  {
    std::unique_lock lock(staging_mutex_, std::defer_lock);  // one staged read at a time
    if (staging_) lock.lock();
    source_->read_into(reads, outs, staging_.get());
  }
  synchronise(device_);
  return buffers;
}

// A streamed slot's parameter on the CPU, straight from the page cache: a read-only view of a
// mapping of its bytes alone (storage::map_tensor) where the checkpoint holds it as it is
// computed. The prefetch starts read-ahead; the op's threads map the pages as they touch them,
// which costs them less than a copy on the prefetch thread would (on a machine with as many
// op threads as cores, that copy takes a core from the op). Unmapped on release, so host
// memory stays flat. Undefined where that cannot be: a resident slot (whose pages the kernel
// could reclaim), O_DIRECT reads, a converter's expression, another dtype, misaligned data.
at::Tensor StreamedWeights::mapped(const Slot& slot, size_t i) const {
  if (slot.resident || source_->direct) return {};
  const storage::TensorInfo* info = source_->stored(*slot.parts[i], slot.forms[i]);
  return info ? storage::map_tensor(source_->map, *info) : at::Tensor();
}

// The computation copies of the slot's weights whose prepared form is not the computation
// dtype (packed ones unpacked, on the computation device); undefined for the others, which the
// op uses as they are prepared.
std::vector<at::Tensor> StreamedWeights::computation_copy(const Slot& slot, const std::vector<at::Tensor>& prepared,
                                                        std::vector<at::Tensor> buffers) const {
  buffers.resize(prepared.size());
  for (size_t i = 0; i < prepared.size(); ++i) {
    if (slot.forms[i] == dtype_) continue;
    buffers[i] = buffer(std::move(buffers[i]), slot.layer->parameters()[i].shape, dtype_);
    source_->convert_into(*slot.parts[i], prepared[i], buffers[i]);
  }
  return buffers;
}

void StreamedWeights::materialise_plan() {
  const config::DeviceState& onload = config_.vram.onload;
  const c10::Device onload_device = onload_on_disk_ ? device_ : torch_device(onload.device);
  const auto onload_dtype = state_dtype(onload.dtype, dtype_);
  // Host copies of a CUDA model's streamed layers are pinned, so they copy asynchronously.
  const bool pin = !device_.is_cpu() && onload_device.is_cpu();
  for (const auto& slot : slots_) {
    if (slot->host) {  // owned copies, which an update may write
      std::vector<at::Tensor> held;
      for (size_t i = 0; i < slot->parts.size(); ++i)
        if (const Assignment* part = slot->parts[i])
          held.push_back(slot->held.empty() ? source_->read(*part, c10::kCPU, dtype_, false)
                                            : source_->convert(*part, slot->held[i], c10::kCPU, dtype_));
      slot->held = std::move(held);
    } else if (slot->resident) {
      slot->tensors = prepare(*slot, {});
      show_values(*slot, true);
      slot->held.clear();
    } else if (slot->from_disk) {
      slot->held.clear();
    } else {
      std::vector<at::Tensor> held;
      for (size_t i = 0; i < slot->parts.size(); ++i) {
        const Assignment* part = slot->parts[i];
        if (!part) continue;
        const c10::ScalarType form = held_dtype(*part, onload_dtype, onload_packed_);
        at::Tensor copy = slot->held.empty() ? source_->read(*part, onload_device, form, false)
                                             : source_->convert(*part, slot->held[i], onload_device, form);
        held.push_back(pin ? copy.pin_memory() : copy);
      }
      slot->held = std::move(held);
    }
  }
  std::lock_guard lock(mutex_);
  in_use_ = stats_.resident;
  stats_.peak = std::max(stats_.peak, in_use_);
}

// A resident slot's prepared tensors as its parameters' values (packed bytes are no value an op
// could use); or, with `resident` false, none (meta tensors): the layer's weights are away.
void StreamedWeights::show_values(Slot& slot, bool resident) const {
  auto parameters = slot.layer->parameters();
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (parameters[i].tied) continue;
    if (!resident) parameters[i].value = at::empty(parameters[i].shape, at::TensorOptions().device(c10::kMeta).dtype(dtype_));
    else if (slot.forms[i] != kPacked) parameters[i].value = slot.tensors[i];
  }
}

StreamedWeights::Slot& StreamedWeights::slot_of(const Layer& layer) {
  auto it = by_layer_.find(&layer);
  if (it == by_layer_.end()) throw Error("layer " + quote(layer.path()) + " is not managed");
  return *it->second;
}

std::vector<at::Tensor> StreamedWeights::acquire(const Layer& layer) {
  Slot& slot = slot_of(layer);
  std::unique_lock lock(mutex_);
  if (order_.asked(&slot)) stats_.order_learned = true;
  if (slot.host) {  // computed where it rests (Layer carries the input across)
    stats_.expert_cpu_ops++;
    return slot.held;
  }
  if (slot.routed) {
    slot.uses++;
    (slot.resident ? stats_.expert_hits : stats_.expert_misses)++;
    if (slot.expected) {
      slot.expected = false;
      expected_.erase(std::find(expected_.begin(), expected_.end(), &slot));
    }
  }
  if (slot.resident && !slot.copy) return slot.tensors;
  const auto start = Clock::now();
  if (!slot.resident) {
    if (slot.state == Slot::State::Ready) {
      stats_.prefetched++;
    } else if (slot.state == Slot::State::Loading) {
      changed_.wait(lock, [&] { return slot.state != Slot::State::Loading; });
      if (slot.state == Slot::State::Ready) stats_.prefetched++;
    }
    if (slot.state == Slot::State::Away) {
      std::vector<at::Tensor> buffers;
      claim_locked(lock, slot, false, slot.bytes, buffers, &slot);
      slot.state = Slot::State::Loading;
      lock.unlock();
      const auto read_start = Clock::now();
      std::vector<at::Tensor> tensors;
      try {
        tensors = prepare(slot, std::move(buffers));
      } catch (...) {
        lock.lock();
        slot.state = Slot::State::Away;
        in_use_ -= slot.bytes;
        throw;
      }
      lock.lock();
      stats_.read_seconds += seconds_since(read_start);
      count_streamed_locked(slot, tensors);
      slot.tensors = std::move(tensors);
    }
    stats_.loads++;
    slot.state = Slot::State::InUse;
  }
  if (slot.copy) {
    std::vector<at::Tensor> buffers;
    claim_locked(lock, slot, true, slot.copy, buffers, &slot);
    lock.unlock();
    auto computed = computation_copy(slot, slot.tensors, std::move(buffers));  // slot.tensors stay while in use
    lock.lock();
    slot.computed = std::move(computed);
  }
  stats_.wait_seconds += seconds_since(start);
  note_locked(slot, "acquire");
  auto tensors = slot.tensors;
  for (size_t i = 0; i < slot.computed.size(); ++i)
    if (slot.computed[i].defined()) tensors[i] = slot.computed[i];
  lock.unlock();
  if (!device_.is_cpu()) {
    // Prefetched weights were allocated on the copy stream: keep their memory from being reused
    // before the ops queued on this thread's stream are done with it.
    const auto stream = c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
    for (const auto& t : tensors) c10::getDeviceAllocator(device_.type())->recordStream(t.storage().data_ptr(), stream);
  }
  if (!slot.resident) prefetch_after(slot.position);
  return tensors;
}

void StreamedWeights::release(const Layer& layer) {
  Slot& slot = slot_of(layer);
  if (slot.host || (slot.resident && !slot.copy)) return;
  {
    std::lock_guard lock(mutex_);
    give_back_locked(slot.computed);
    if (!slot.resident && !(slot.routed && promote_locked(slot))) {
      give_back_locked(slot.tensors);
      slot.state = Slot::State::Away;
    }
    note_locked(slot, "release");
  }
  changed_.notify_all();
  if (!slot.resident) prefetch_after(slot.position);
}

uint64_t StreamedWeights::sleep() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return prefetch_queue_.empty() &&
           std::none_of(slots_.begin(), slots_.end(), [](auto& s) { return s->state == Slot::State::Loading; });
  });
  const config::DeviceState& state = config_.vram.offload;
  uint64_t moved = state.device.is_disk() ? in_use_ : 0;  // released, or moved into the offload state
  for (const auto& slot : slots_) {
    if (state.device.is_disk()) {
      slot->held.clear();
    } else {
      const c10::Device device = torch_device(state.device);
      const auto dtype = state_dtype(state.dtype, dtype_);
      std::vector<at::Tensor> held;
      const auto& from = slot->resident ? slot->tensors : slot->held;
      for (size_t i = 0; i < slot->parts.size(); ++i) {
        const Assignment* part = slot->parts[i];
        if (!part) continue;
        const c10::ScalarType form = held_dtype(*part, dtype, offload_packed_);
        held.push_back(from.empty() ? source_->read(*part, device, form, false)
                                    : source_->convert(*part, from[i], device, form));
        moved += held.back().nbytes();
      }
      slot->held = std::move(held);
    }
    slot->tensors.clear();
    slot->computed.clear();
    slot->state = Slot::State::Away;
    show_values(*slot, false);
  }
  spares_.clear();
  stats_.staging = 0;
  in_use_ = 0;
  return moved;
}

uint64_t StreamedWeights::wake() {
  materialise_plan();
  std::lock_guard lock(mutex_);
  return stats_.resident;
}

bool StreamedWeights::start_trace() {
  std::lock_guard lock(mutex_);
  trace_.clear();
  trace_start_ = Clock::now();
  return true;
}

std::vector<VramEvent> StreamedWeights::take_trace() {
  std::lock_guard lock(mutex_);
  trace_start_.reset();
  return std::move(trace_);
}

std::optional<VramStats> StreamedWeights::stats() const {
  std::unique_lock lock(mutex_);
  VramStats now = stats_;
  now.held = in_use_;
  lock.unlock();
  if (staging_) {
    std::lock_guard staging(staging_mutex_);
    now.host_staging = staging_->host_bytes();
  }
  now.plan = describe(now, config_, prepared_dtype_, dtype_, source_->direct_why) + ", peak " + format_bytes(now.peak);
  return now;
}

// Counted from the tensors themselves, apart from the plan that weights/holdings.hpp charges:
// the bytes on the computation device (under the limit), every copy resting in the onload state
// (or, asleep, the offload state), wherever it is, the experts computed on the CPU, and the
// pinned buffers reads to a GPU go through.
std::map<std::string, uint64_t> StreamedWeights::bytes_by_device() const {
  std::map<std::string, uint64_t> bytes;
  {
    std::lock_guard lock(mutex_);
    if (in_use_) bytes[device_.str()] += in_use_;
    for (const auto& slot : slots_)
      for (const auto& t : slot->held) bytes[t.device().str()] += t.nbytes();
  }
  if (staging_) {
    std::lock_guard staging(staging_mutex_);
    if (const uint64_t host = staging_->host_bytes()) bytes["cpu"] += host;
  }
  return bytes;
}

std::string StreamedWeights::describe(const VramStats& s, const config::ModelConfig& config, c10::ScalarType prepared,
                                      c10::ScalarType dtype, const std::string& direct_why) {
  std::string text = std::to_string(s.resident_slots) + " of " + std::to_string(s.slots) + " layers resident (" +
                     format_bytes(s.resident) + " in " + dtype_text(prepared) + (s.packed ? " and packed" : "") + ")";
  if (s.host_expert_slots)
    text += ", " + std::to_string(s.host_expert_slots) + " expert layers computed on the CPU (" +
            format_bytes(s.host_experts) + " in host memory)";
  if (const size_t from_onload = s.slots - s.resident_slots - s.disk_slots - s.host_expert_slots)
    text += ", " + std::to_string(from_onload) + " streamed from " + config.vram.onload.device.str() + " (" +
            format_bytes(s.total - s.resident - s.disk) + ")";
  if (s.disk_slots)
    text += ", " + std::to_string(s.disk_slots) + " streamed from disk (" + format_bytes(s.disk) + "; " + direct_why + ")";
  if (s.packed)
    text += "; GGUF blocks packed: " + format_bytes(s.packed) + " of " + format_bytes(s.total) +
            ", unpacked into " + dtype_text(dtype) + " right before each op";
  text += "; room kept: " + format_bytes(s.streaming) +
          (prepared != dtype || s.packed ? ", computed in " + dtype_text(dtype) : "");
  return text + "; limit " + (s.limit ? format_bytes(s.limit) : std::string("none"));
}

}  // namespace vramd::weights
