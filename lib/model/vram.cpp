#include "model/vram.hpp"

#include <algorithm>
#include <chrono>
#include <map>

#include "convert/expr.hpp"
#include "model/model.hpp"
#include "model/weight_source.hpp"
#include "storage/tensor_io.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

struct WeightManager::Slot {
  Layer* layer = nullptr;
  std::vector<const Assignment*> parts;  // per parameter (a tied one: its leader's); null: never loaded
  uint64_t bytes = 0;
  bool resident = false;
  enum class State { Away, Loading, Ready, InUse } state = State::Away;
  std::vector<at::Tensor> tensors;  // on the computation device while resident, Ready or InUse
  std::vector<at::Tensor> held;     // copies in the onload (or, asleep, offload) state; empty: on disk
  size_t position = 0;              // in order_
};

WeightManager::WeightManager(Model& model, std::shared_ptr<WeightSource> source, const config::ModelConfig& config)
    : model_(model), source_(std::move(source)), config_(config), device_(config.vram.computation.device),
      dtype_(model.dtype()) {
  std::map<const Parameter*, const Assignment*> by_parameter;
  for (const auto& a : source_->assignments) by_parameter[a.parameter] = &a;
  for (const auto& layer : model.layers()) {
    auto slot = std::make_unique<Slot>();
    slot->layer = layer.get();
    for (const auto& parameter : layer->parameters()) {
      const Parameter* owner = parameter.tied ? parameter.tied : &parameter;
      auto it = by_parameter.find(owner);
      slot->parts.push_back(it == by_parameter.end() ? nullptr : it->second);
      slot->bytes += static_cast<uint64_t>(parameter.elements()) * c10::elementSize(dtype_);
    }
    slot->position = slots_.size();
    order_.push_back(slot.get());
    slots_.push_back(std::move(slot));
  }

  // The plan: everything resident when it fits; else room to stream the largest slots, and the
  // smallest slots resident in what is left.
  const uint64_t limit = *config.vram.limit;
  uint64_t total = 0, largest = 0;
  for (const auto& slot : slots_) {
    total += slot->bytes;
    largest = std::max(largest, slot->bytes);
  }
  stats_.limit = limit;
  stats_.total = total;
  stats_.slots = slots_.size();
  if (total > limit && limit < largest)
    fail(config.path, "vram.limit = " + format_bytes(limit) + " cannot hold the largest layer (" + format_bytes(largest) +
                          " in " + std::string(c10::toString(dtype_)) + "); raise it to at least that");
  const std::string& onload = config.vram.onload.device;
  onload_on_disk_ = onload == "disk";
  if (total > limit && !onload_on_disk_ && c10::Device(onload) == device_)
    fail(config.path, "vram.onload.device = " + onload + " is the computation device, so every weight would count against "
                      "vram.limit (" + format_bytes(limit) + " < " + format_bytes(total) +
                      "); use \"disk\" or another device for onload and offload");
  stats_.streaming = total <= limit ? 0 : limit >= 3 * largest ? 2 * largest : largest;
  std::vector<Slot*> by_size;
  for (const auto& slot : slots_) by_size.push_back(slot.get());
  std::stable_sort(by_size.begin(), by_size.end(), [](Slot* a, Slot* b) { return a->bytes < b->bytes; });
  for (Slot* slot : by_size) {
    if (stats_.resident + slot->bytes > limit - stats_.streaming) break;
    slot->resident = true;
    stats_.resident += slot->bytes;
    stats_.resident_slots++;
  }
  materialise_plan();
  prefetcher_ = std::thread([this] { prefetch_loop(); });
  for (const auto& layer : model.layers()) layer->set_manager(this);
}

WeightManager::~WeightManager() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  prefetcher_.join();
  for (const auto& layer : model_.layers()) layer->set_manager(nullptr);
}

std::vector<at::Tensor> WeightManager::read(const Slot& slot, bool to_device) const {
  std::vector<at::Tensor> values;
  for (size_t i = 0; i < slot.parts.size(); ++i) {
    const Assignment* part = slot.parts[i];
    if (!part)
      throw Error("layer " + quote(slot.layer->path()) + ": parameter " + quote(slot.layer->parameters()[i].name) +
                  " was never loaded");
    if (!slot.held.empty()) values.push_back(to_device ? slot.held[i].to(device_, dtype_) : slot.held[i]);
    else values.push_back(source_->read(*part, to_device ? device_ : c10::Device(c10::kCPU), dtype_, false));
  }
  return values;
}

void WeightManager::materialise_plan() {
  const config::DeviceState& onload = config_.vram.onload;
  for (const auto& slot : slots_) {
    if (slot->resident) {
      slot->tensors = read(*slot, true);
      auto parameters = slot->layer->parameters();
      for (size_t i = 0; i < parameters.size(); ++i)
        if (!parameters[i].tied) parameters[i].value = slot->tensors[i];
    } else if (!onload_on_disk_) {
      const c10::Device device(onload.device);
      const auto dtype = state_dtype(onload.dtype, dtype_);
      std::vector<at::Tensor> held;
      for (size_t i = 0; i < slot->parts.size(); ++i)
        if (slot->parts[i]) held.push_back(slot->held.empty() ? source_->read(*slot->parts[i], device, dtype, false)
                                                             : slot->held[i].to(device, dtype));
      slot->held = std::move(held);
    }
    if (slot->resident && onload_on_disk_) slot->held.clear();
  }
  std::lock_guard lock(mutex_);
  in_use_ = stats_.resident;
  stats_.peak = std::max(stats_.peak, in_use_);
}

WeightManager::Slot& WeightManager::slot_of(const Layer& layer) {
  for (const auto& slot : slots_)
    if (slot->layer == &layer) return *slot;
  throw Error("layer " + quote(layer.path()) + " is not managed");
}

// Makes room for `bytes` more on the computation device: waits for loads under way and drops
// prefetched slots the op does not need now, furthest ahead first.
bool WeightManager::reserve_locked(std::unique_lock<std::mutex>& lock, uint64_t bytes, const Slot* needed) {
  while (in_use_ + bytes > stats_.limit) {
    Slot* victim = nullptr;
    for (auto it = order_.rbegin(); it != order_.rend(); ++it)
      if (*it != needed && (*it)->state == Slot::State::Ready && !(*it)->resident) {
        victim = *it;
        break;
      }
    if (victim) {
      victim->tensors.clear();
      victim->state = Slot::State::Away;
      in_use_ -= victim->bytes;
      continue;
    }
    if (!needed) return false;  // a prefetch does not wait
    changed_.wait(lock);
    if (stopping_) return false;
  }
  in_use_ += bytes;
  stats_.peak = std::max(stats_.peak, in_use_);
  return true;
}

std::vector<at::Tensor> WeightManager::acquire(const Layer& layer) {
  Slot& slot = slot_of(layer);
  std::unique_lock lock(mutex_);
  if (learning_) {
    if (std::find(seen_.begin(), seen_.end(), &slot) != seen_.end()) {
      // The second forward has begun: the first one's order is the execution order.
      for (const auto& s : slots_)
        if (std::find(seen_.begin(), seen_.end(), s.get()) == seen_.end()) seen_.push_back(s.get());
      order_ = seen_;
      for (size_t i = 0; i < order_.size(); ++i) order_[i]->position = i;
      learning_ = false;
      stats_.order_learned = true;
    } else {
      seen_.push_back(&slot);
    }
  }
  if (slot.resident) return slot.tensors;
  const auto start = Clock::now();
  if (slot.state == Slot::State::Ready) {
    stats_.prefetched++;
  } else if (slot.state == Slot::State::Loading) {
    changed_.wait(lock, [&] { return slot.state != Slot::State::Loading; });
    if (slot.state == Slot::State::Ready) stats_.prefetched++;
  }
  if (slot.state == Slot::State::Away) {
    reserve_locked(lock, slot.bytes, &slot);
    slot.state = Slot::State::Loading;
    lock.unlock();
    const auto read_start = Clock::now();
    std::vector<at::Tensor> tensors;
    try {
      tensors = read(slot, true);
    } catch (...) {
      lock.lock();
      slot.state = Slot::State::Away;
      in_use_ -= slot.bytes;
      throw;
    }
    lock.lock();
    stats_.read_seconds += seconds_since(read_start);
    stats_.bytes_streamed += slot.bytes;
    slot.tensors = std::move(tensors);
  }
  stats_.loads++;
  stats_.wait_seconds += seconds_since(start);
  slot.state = Slot::State::InUse;
  auto tensors = slot.tensors;
  lock.unlock();
  prefetch_after(slot.position);
  return tensors;
}

void WeightManager::release(const Layer& layer) {
  Slot& slot = slot_of(layer);
  if (slot.resident) return;
  {
    std::lock_guard lock(mutex_);
    slot.tensors.clear();
    slot.state = Slot::State::Away;
    in_use_ -= slot.bytes;
  }
  changed_.notify_all();
  prefetch_after(slot.position);
}

// Queues the streamed slots after `position` (wrapping into the next forward) while they fit.
void WeightManager::prefetch_after(size_t position) {
  std::unique_lock lock(mutex_);
  const size_t n = order_.size();
  for (size_t step = 1; step < n; ++step) {
    Slot* next = order_[(position + step) % n];
    if (next->resident) continue;
    if (next->state != Slot::State::Away) continue;
    if (in_use_ + next->bytes > stats_.limit) break;  // in order: never skip ahead of one that waits
    in_use_ += next->bytes;
    stats_.peak = std::max(stats_.peak, in_use_);
    next->state = Slot::State::Loading;
    prefetch_queue_.push_back(next);
  }
  lock.unlock();
  changed_.notify_all();
}

void WeightManager::prefetch_loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || !prefetch_queue_.empty(); });
    if (stopping_) return;
    Slot* slot = prefetch_queue_.front();
    prefetch_queue_.erase(prefetch_queue_.begin());
    lock.unlock();
    const auto start = Clock::now();
    std::vector<at::Tensor> tensors;
    bool ok = true;
    try {
      tensors = read(*slot, true);
    } catch (...) {
      ok = false;  // the op that needs it reads it itself and reports the error
    }
    lock.lock();
    stats_.read_seconds += seconds_since(start);
    if (ok) {
      stats_.bytes_streamed += slot->bytes;
      slot->tensors = std::move(tensors);
      slot->state = Slot::State::Ready;
    } else {
      slot->state = Slot::State::Away;
      in_use_ -= slot->bytes;
    }
    changed_.notify_all();
  }
}

uint64_t WeightManager::sleep(const config::DeviceState& state) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return prefetch_queue_.empty() &&
           std::none_of(slots_.begin(), slots_.end(), [](auto& s) { return s->state == Slot::State::Loading; });
  });
  uint64_t moved = 0;
  for (const auto& slot : slots_) {
    moved += slot->resident || slot->state == Slot::State::Ready ? slot->bytes : 0;
    if (state.device != "disk") {
      const c10::Device device(state.device);
      const auto dtype = state_dtype(state.dtype, dtype_);
      std::vector<at::Tensor> held;
      const auto& from = slot->resident ? slot->tensors : slot->held;
      if (!from.empty()) {
        for (const auto& t : from) held.push_back(t.to(device, dtype));
      } else {
        for (const auto* part : slot->parts)
          if (part) held.push_back(source_->read(*part, device, dtype, false));
      }
      slot->held = std::move(held);
    } else {
      slot->held.clear();
    }
    slot->tensors.clear();
    slot->state = Slot::State::Away;
    for (auto& parameter : slot->layer->parameters())
      if (!parameter.tied) parameter.value = at::empty(parameter.shape, at::TensorOptions().device(c10::kMeta).dtype(dtype_));
  }
  in_use_ = 0;
  return moved;
}

uint64_t WeightManager::wake() {
  materialise_plan();
  std::lock_guard lock(mutex_);
  return stats_.resident;
}

VramStats WeightManager::stats() const {
  std::lock_guard lock(mutex_);
  VramStats now = stats_;
  now.held = in_use_;
  return now;
}

std::string WeightManager::describe() const {
  const VramStats s = stats();
  return std::to_string(s.resident_slots) + " of " + std::to_string(s.slots) + " layers resident (" +
         format_bytes(s.resident) + "), " + std::to_string(s.slots - s.resident_slots) + " streamed from " +
         config_.vram.onload.device + " (" + format_bytes(s.total - s.resident) + ", room kept: " +
         format_bytes(s.streaming) + "); limit " + format_bytes(s.limit) + ", peak " + format_bytes(s.peak);
}

}  // namespace vramd::model
