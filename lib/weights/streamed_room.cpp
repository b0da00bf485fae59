// StreamedWeights' bytes under the limit (weights/streamed.hpp): every byte on the computation
// device is reserved here first, spare buffers are kept for the next layers within the limit,
// and room is made by dropping spares, then prefetched layers, furthest ahead first.
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

void StreamedWeights::note_locked(const Slot& slot, const char* kind) {
  if (trace_start_ && trace_.size() < (1u << 20))
    trace_.push_back({seconds_since(*trace_start_), in_use_, slot.layer, kind});
}

void StreamedWeights::evict_locked(Slot& slot) {
  slot.tensors.clear();
  slot.state = Slot::State::Away;
  in_use_ -= slot.bytes;
  note_locked(slot, "evict");
}

// Makes room for `bytes` more on the computation device: drops spare buffers, then (for an op
// that needs them now) prefetched slots, furthest ahead first, then waits for loads under way.
// A prefetch (`needed` null) neither evicts nor waits. Without a limit every slot is prepared and
// only computation copies are claimed, one op's at a time: spares are kept within what stays
// prepared and the room kept for those copies (what the budget charges), and nothing waits.
bool StreamedWeights::reserve_locked(std::unique_lock<std::mutex>& lock, uint64_t bytes, const Slot* needed) {
  const uint64_t cap = limit_ == UINT64_MAX ? stats_.resident + stats_.streaming : limit_;
  while (in_use_ + bytes > cap) {
    if (!spares_.empty()) {
      in_use_ -= spares_.back().nbytes();
      stats_.staging -= spares_.back().nbytes();
      spares_.pop_back();
      continue;
    }
    if (limit_ == UINT64_MAX) break;
    if (!needed) return false;
    // Furthest ahead first; an expert expected soon last.
    Slot* victim = nullptr;
    for (const bool expected : {false, true})
      for (auto it = order_.rbegin(); it != order_.rend() && !victim; ++it)
        if (*it != needed && (*it)->state == Slot::State::Ready && !(*it)->resident && (*it)->expected == expected)
          victim = *it;
    if (victim) {
      evict_locked(*victim);
      continue;
    }
    changed_.wait(lock);
    if (stopping_) return false;
  }
  in_use_ += bytes;
  stats_.peak = std::max(stats_.peak, in_use_);
  return true;
}

// Buffers for the slot's parameters in `dtype` (`bytes` in all): for each, the largest spare no
// larger than it (the same size where there is one; whoever fills it refits it: buffer()), and
// room reserved for the rest. Never a larger spare: until refitted it would hold more memory
// than is counted. Buffers left undefined are allocated by whoever fills them.
bool StreamedWeights::claim_locked(std::unique_lock<std::mutex>& lock, const Slot& slot, bool copy, uint64_t bytes,
                                   std::vector<at::Tensor>& buffers, const Slot* needed) {
  buffers.assign(slot.parts.size(), at::Tensor());
  uint64_t taken = 0;
  const auto parameters = slot.layer->parameters();
  for (size_t i = 0; i < buffers.size() && !spares_.empty(); ++i) {
    if (copy && slot.forms[i] == dtype_) continue;  // used as prepared: no copy
    const c10::ScalarType dtype = copy ? dtype_ : slot.forms[i];
    const auto shape = copy || !slot.parts[i] ? parameters[i].shape : held_shape(*slot.parts[i], dtype);
    const uint64_t nbytes = storage::element_count(shape) * c10::elementSize(dtype);
    auto it = spares_.end();
    for (auto s = spares_.begin(); s != spares_.end(); ++s)
      if (s->nbytes() <= nbytes && (it == spares_.end() || s->nbytes() > it->nbytes())) it = s;
    if (it == spares_.end()) continue;
    taken += it->nbytes();
    stats_.staging -= it->nbytes();
    buffers[i] = std::move(*it);
    spares_.erase(it);
  }
  if (reserve_locked(lock, bytes - taken, needed)) return true;
  for (auto& buffer : buffers)
    if (buffer.defined()) stats_.staging += buffer.nbytes(), spares_.push_back(std::move(buffer));
  buffers.clear();
  return false;
}

// `buffer`, a spare from claim_locked or undefined, as the computation device's buffer for
// `shape` in `dtype` beginning `phase` bytes into a page (on the CPU).
at::Tensor StreamedWeights::buffer(at::Tensor buffer, c10::IntArrayRef shape, c10::ScalarType dtype, uint64_t phase) const {
  if (!buffer.defined()) return fresh_buffer(shape, dtype, device_, phase);
  return refit_buffer(std::move(buffer), shape, dtype, phase);
}

void StreamedWeights::count_streamed_locked(const Slot& slot, const std::vector<at::Tensor>& tensors) {
  stats_.bytes_streamed += slot.bytes;
  if (slot.routed) stats_.expert_bytes_streamed += slot.bytes;
  for (const auto& t : slot.held) stats_.bytes_moved += t.nbytes();  // prepare carried them as held
  for (const auto& t : tensors) {
    if (storage::is_mapped_view(t)) stats_.bytes_mapped += t.nbytes();
    else if (slot.held.empty()) stats_.bytes_moved += t.nbytes();  // read from the checkpoint
    if (t.scalar_type() == kPacked) stats_.bytes_packed += t.nbytes();
  }
}

// Released weights become spares for the next streamed slots where nothing else holds them.
void StreamedWeights::give_back_locked(std::vector<at::Tensor>& tensors) {
  for (auto& tensor : tensors) {
    if (!tensor.defined()) continue;  // a computation copy the op did not need
    if (pool_ && tensor.use_count() == 1 && tensor.storage().use_count() == 1 && !storage::is_mapped_view(tensor)) {
      stats_.staging += tensor.nbytes();
      spares_.push_back(std::move(tensor));  // claim_locked gives it to a slot, buffer() refits it
    } else {
      in_use_ -= tensor.nbytes();
    }
  }
  tensors.clear();
}

}  // namespace vramd::weights
