// StreamedWeights' layers brought in before their op asks (weights/streamed.hpp): in the order
// the first forward ran them, always within the limit, on a thread of its own (on CUDA, a stream
// of its own); and experts, brought in only when routed to, kept in place of those routed to
// less often.
#include "weights/streamed_slot.hpp"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>

#include "storage/tensor_io.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "weights/lease.hpp"
#include "weights/source.hpp"

namespace vramd::weights {

using model::Layer;
using model::Parameter;
using model::VramStats;
using Clock = std::chrono::steady_clock;

// Queues the expected experts, then the streamed slots after `position` while they fit,
// wrapping into the next forward once one forward has followed another: a model run once
// (vramctl run) reads each streamed layer once, and a served one has the next request's first
// layers ready. Routed slots come in only when expected: no order says which runs next.
void StreamedWeights::prefetch_after(size_t position) {
  std::unique_lock lock(mutex_);
  if (queue_expected_locked(lock)) {
    const size_t n = order_.size();
    const size_t steps = order_.learned() ? n : n - position;
    for (size_t step = 1; step < steps; ++step) {
      Slot* next = order_[(position + step) % n];
      if (next->resident || next->routed || next->state != Slot::State::Away) continue;
      if (!queue_locked(lock, *next)) break;  // never skip ahead
    }
  }
  lock.unlock();
  changed_.notify_all();
}

// Claims room for the slot without evicting anything and queues its read; false when it does
// not fit now.
bool StreamedWeights::queue_locked(std::unique_lock<std::mutex>& lock, Slot& slot) {
  std::vector<at::Tensor> buffers;
  if (!claim_locked(lock, slot, false, slot.bytes, buffers, nullptr)) return false;
  slot.tensors = std::move(buffers);
  slot.state = Slot::State::Loading;
  note_locked(slot, "prefetch");
  prefetch_queue_.push_back(&slot);
  return true;
}

// Queues the expected experts that are away, in the order they run; false while one does not fit.
bool StreamedWeights::queue_expected_locked(std::unique_lock<std::mutex>& lock) {
  for (Slot* slot : expected_)
    if (slot->state == Slot::State::Away && !queue_locked(lock, *slot)) return false;
  return true;
}

// Those not asked for since they were expected (a forward stopped between) are expected no more.
void StreamedWeights::expect(std::span<const Layer* const> layers) {
  std::unique_lock lock(mutex_);
  for (Slot* stale : expected_) stale->expected = false;
  expected_.clear();
  for (const Layer* layer : layers) {
    Slot& slot = slot_of(*layer);
    if (slot.resident || slot.host || !slot.routed || slot.expected) continue;
    slot.expected = true;
    expected_.push_back(&slot);
  }
  queue_expected_locked(lock);
  lock.unlock();
  changed_.notify_all();
}

// After the op of a streamed expert: keeps it prepared in place of the resident expert routed to
// least often, when it was routed to more often and is of the same size (a view of the checkpoint's
// pages copied into memory of its own, as resident weights are). The one made to stream rests
// where the other did (in the onload state, or re-read from the checkpoint, which an updated
// model's weights no longer are: then nothing changes). Neither the bytes on the computation
// device nor those in the onload state change, so the limit and the charge hold.
bool StreamedWeights::promote_locked(Slot& slot) {
  Slot* coldest = nullptr;
  for (const auto& other : slots_)
    if (other->routed && other->resident && other->bytes == slot.bytes && (!coldest || other->uses < coldest->uses))
      coldest = other.get();
  if (!coldest || coldest->uses >= slot.uses || (slot.held.empty() && updated_)) return false;
  for (auto& t : slot.tensors)  // a view of the page cache is no copy of its own: made one (CPU)
    if (storage::is_mapped_view(t)) t = fresh_buffer(t.sizes(), t.scalar_type(), device_).copy_(t);
  if (!slot.held.empty()) {
    const c10::Device onload = torch_device(config_.vram.onload.device);
    const auto onload_dtype = state_dtype(config_.vram.onload.dtype, dtype_);
    std::vector<at::Tensor> held;
    for (size_t i = 0; i < coldest->parts.size(); ++i) {
      const Assignment* part = coldest->parts[i];
      if (!part) continue;
      at::Tensor copy = source_->convert(*part, coldest->tensors[i], onload, held_dtype(*part, onload_dtype, onload_packed_));
      held.push_back(!device_.is_cpu() && onload.is_cpu() ? copy.pin_memory() : copy);
    }
    for (const auto& t : slot.held) stats_.onload -= t.nbytes();
    for (const auto& t : held) stats_.onload += t.nbytes();
    coldest->held = std::move(held);
    slot.held.clear();
  } else {
    coldest->from_disk = true;
    slot.from_disk = false;
    stats_.disk += coldest->bytes;
    stats_.disk -= slot.bytes;
  }
  show_values(*coldest, false);
  coldest->tensors.clear();
  coldest->resident = false;
  coldest->state = Slot::State::Away;
  in_use_ -= coldest->bytes;
  note_locked(*coldest, "evict");
  show_values(slot, true);
  slot.resident = true;
  slot.state = Slot::State::Ready;
  stats_.resident = stats_.resident - coldest->bytes + slot.bytes;
  stats_.expert_swaps++;
  return true;
}

void StreamedWeights::prefetch_loop() {
  // On CUDA, copies run on a stream of their own, beside the ops on the computation stream.
  std::optional<c10::StreamGuard> copy_stream;
  if (!device_.is_cpu()) copy_stream.emplace(c10::impl::VirtualGuardImpl(device_.type()).getStreamFromGlobalPool(device_));
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || !prefetch_queue_.empty(); });
    if (stopping_) return;
    Slot* slot = prefetch_queue_.front();
    prefetch_queue_.erase(prefetch_queue_.begin());
    std::vector<at::Tensor> buffers = std::move(slot->tensors);
    lock.unlock();
    const auto start = Clock::now();
    std::vector<at::Tensor> tensors;
    bool ok = true;
    try {
      tensors = prepare(*slot, std::move(buffers));
    } catch (...) {
      ok = false;  // the op that needs it reads it itself and reports the error
    }
    lock.lock();
    stats_.read_seconds += seconds_since(start);
    if (ok) {
      count_streamed_locked(*slot, tensors);
      slot->tensors = std::move(tensors);
      slot->state = Slot::State::Ready;
      note_locked(*slot, "ready");
    } else {
      slot->tensors.clear();
      slot->state = Slot::State::Away;
      in_use_ -= slot->bytes;
    }
    changed_.notify_all();
  }
}

}  // namespace vramd::weights
