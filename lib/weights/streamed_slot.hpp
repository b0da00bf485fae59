// One weight-holding layer of StreamedWeights (weights/streamed.hpp) and its states, for the
// files of its code alone: streamed.cpp (the plan, an op's weights, sleep and wake, figures),
// streamed_room.cpp (the bytes under the limit), streamed_prefetch.cpp (bringing the next layers
// in, experts promoted) and streamed_update.cpp (new values).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "model/layer.hpp"
#include "weights/source.hpp"
#include "weights/streamed.hpp"

namespace vramd::weights {

struct StreamedWeights::Slot {
  model::Layer* layer = nullptr;
  std::vector<const Assignment*> parts;  // per parameter (a tied one: its leader's); null: never loaded
  std::vector<c10::ScalarType> forms;    // per parameter, its dtype prepared (kPacked: its GGUF blocks)
  uint64_t bytes = 0;      // prepared, in the preparing dtype
  uint64_t copy = 0;       // the computation copy while the op runs (0: preparing is computation)
  bool resident = false;
  bool from_disk = false;  // streamed and re-read from the checkpoint (onload "disk", or past vram.onload_limit)
  bool routed = false;     // an expert's projection: brought in only when expected or asked for
  bool host = false;       // routed and computed on the CPU from `held` ([vram].experts = "cpu")
  bool expected = false;   // routed, and its op expected soon (in expected_)
  uint64_t uses = 0;       // ops since load, for which routed slots stay resident
  enum class State { Away, Loading, Ready, InUse } state = State::Away;  // streamed slots only
  std::vector<at::Tensor> tensors;   // prepared; while Loading, the buffers to read into
  std::vector<at::Tensor> computed;  // the computation copy while the op runs
  std::vector<at::Tensor> held;      // copies in the onload (or, asleep, offload) state; empty: on disk
  size_t position = 0;               // in order_
};

}  // namespace vramd::weights
