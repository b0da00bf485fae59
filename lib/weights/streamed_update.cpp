// New values for StreamedWeights (weights/streamed.hpp), written where each weight rests; and
// why no lease can hold them.
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

// Written where each weight rests, in that state's dtype: a resident slot's prepared tensors on
// the computation device, a streamed slot's onload copies (a tied weight in every slot that
// holds it). In place, so that neither the limit nor the onload device holds a second copy; no
// lease can hold a streamed model's weights. Values that could change while read (a path) are
// copied into host memory and checked first, so that nothing is written from a file cut short.
// A slot prefetched from the version before is evicted: its next use prepares the new one.
void StreamedWeights::update(const std::string& model, const WeightUpdate& update) {
  std::multimap<const Parameter*, std::pair<Slot*, size_t>> homes;
  for (const auto& slot : slots_)
    for (size_t i = 0; i < slot->parts.size(); ++i)
      if (slot->parts[i]) homes.emplace(slot->parts[i]->parameter, std::pair{slot.get(), i});
  const auto onload_dtype = state_dtype(config_.vram.onload.dtype, dtype_);
  for (const auto& [parameter, value] : update.values)
    for (auto [it, end] = homes.equal_range(parameter); it != end; ++it) {
      const auto& [slot, i] = it->second;
      if (slot->from_disk)
        throw NotUpdatable("model " + quote(model) + " streams layer " + quote(slot->layer->path()) + " from disk, " +
                           "re-read from the checkpoint at each use: it cannot take an update; rest it in memory " +
                           "([vram].onload on a device, within onload_limit) to update it");
      const bool packed = slot->host       ? false
                          : slot->resident ? slot->forms[i] == kPacked
                                           : held_dtype(*slot->parts[i], onload_dtype, onload_packed_) == kPacked;
      if (packed) throw packed_not_updatable(model, parameter->name);
    }
  std::vector<at::Tensor> values;
  for (const auto& [parameter, value] : update.values)
    values.push_back(update.in_place ? value : value.contiguous().clone());
  if (update.check) update.check();

  for (const Parameter* parameter : update.reread)
    for (auto [it, end] = homes.equal_range(parameter); it != end; ++it)
      if (!it->second.first->from_disk)
        throw Error("model " + quote(model) + ": " + quote(parameter->name) + " rests in layer " +
                    quote(it->second.first->layer->path()) + ", which is not re-read at each use");

  std::unique_lock lock(mutex_);
  updated_ = updated_ || !update.values.empty();
  changed_.wait(lock, [&] {
    return prefetch_queue_.empty() &&
           std::none_of(slots_.begin(), slots_.end(), [](auto& s) { return s->state == Slot::State::Loading; });
  });
  // Read before (prefetched for the next forward): the next use reads it anew.
  for (const Parameter* parameter : update.reread)
    for (auto [it, end] = homes.equal_range(parameter); it != end; ++it)
      if (Slot* slot = it->second.first; slot->state == Slot::State::Ready) evict_locked(*slot);
  std::vector<std::pair<at::Tensor, at::Tensor>> writes;
  for (size_t v = 0; v < values.size(); ++v)
    for (auto [it, end] = homes.equal_range(update.values[v].first); it != end; ++it) {
      auto& [slot, i] = it->second;
      if (slot->resident) {
        writes.emplace_back(slot->tensors[i], values[v]);
      } else {
        writes.emplace_back(slot->held[i], values[v]);
        if (slot->state == Slot::State::Ready) evict_locked(*slot);
      }
    }
  write_values(writes);
}

bool StreamedWeights::rereads(const Parameter& parameter) const {
  std::lock_guard lock(mutex_);
  bool held = false;
  for (const auto& slot : slots_)
    for (const Assignment* part : slot->parts)
      if (part && part->parameter == &parameter) {
        if (!slot->from_disk) return false;
        held = true;
      }
  return held;
}

void StreamedWeights::check_leasable(const std::string& model, const std::string&) const {
  throw NotLeasable("model " + quote(model) + " streams its weights under its [vram] table (a limit, a preparing " +
                    "dtype of its own, or GGUF blocks held packed), so they are never all resident in their computation " +
                    "dtype; a lease needs them so: remove [vram].limit, [vram].preparing and packed = true from its " +
                    "config to lease it");
}

}  // namespace vramd::weights
