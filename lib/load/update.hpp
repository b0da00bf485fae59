// New values for a loaded model's weights, from a safetensors file's bytes or a checkpoint read as
// the config's is: checked whole, then taken as one step (weights::Weights::update).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>

#include "config/model_config.hpp"
#include "util/error.hpp"
#include "weights/loaded_model.hpp"

namespace vramd::load {

// An update's tensors do not fit the model (the message names the tensor and why), or its
// file cannot be read: the request's fault, HTTP 400.
class BadUpdate : public Error {
 public:
  using Error::Error;
};

struct UpdateReport {
  size_t tensors = 0;  // parameters given new values
  uint64_t bytes = 0;  // of those values, as the model holds them
};

// Where an update's new values may go (weights::WeightUpdate): `room`, bytes by device reserved
// for values written beside the old ones; `shared_in_place`, whether weights in a lease's GPU
// memory take them where they are (no lease that keeps its values holds it).
struct UpdateSpace {
  std::map<std::string, uint64_t> room;
  bool shared_in_place = false;
  std::function<void(std::shared_ptr<weights::SharedRegion>)> shared;  // weights::WeightUpdate::shared
};
// `update` given where `space` lets its values go (its room, shared_in_place and shared).
void place(weights::WeightUpdate& update, const UpdateSpace& space);

// New values for some of a loaded, awake model's weights, checked whole (every name a
// parameter's, every shape its shape, every dtype floating, none twice) before any weight
// changes, then swapped in as one step (weights::Weights::update). Tied parameters take their
// values through the parameter they are tied to, as at load; names the architecture ignores
// are skipped as at load. Throws BadUpdate naming `where` and every tensor at fault;
// weights::NotUpdatable where the weights cannot take an update.
//
// `safetensors`: a file's bytes whose tensors are named as the model's parameters (as a
// lease's manifest names them), which cannot change while they are read (the request's body, a
// sealed memfd), so that weights may take them in place; `where` names them in errors.
// `before_write` runs once every value is read and checked, before any weight takes one.
// `shared`, where given, owns the bytes, which are sealed shared memory: weights may keep views
// of them as their values (weights::WeightUpdate::adopt), and keep `shared` alive while they do.
UpdateReport update_from_bytes(weights::LoadedModel& loaded, const config::ModelConfig& config, std::span<const std::byte> safetensors,
                               const std::string& where, const UpdateSpace& space,
                               std::function<void()> before_write = {}, std::shared_ptr<void> shared = {});
// `path`: a checkpoint read as the config's is (its readers, prefix and converter), holding
// some or all of the tensors that checkpoint holds.
// Both take `space` (above), and throw weights::UpdateNeedsRoom when its room is not enough.
UpdateReport update_from_checkpoint(weights::LoadedModel& loaded, const config::ModelConfig& config, const std::string& path,
                                    const UpdateSpace& space);
// The checkpoint at `path`, read as update_from_checkpoint reads it, as the bytes of one
// safetensors file of its converted tensors (for update_from_bytes): what rank 0 of a
// partitioned model hands the other ranks. Throws BadUpdate naming the file.
std::string checkpoint_as_safetensors(const weights::LoadedModel& loaded, const config::ModelConfig& config, const std::string& path);

}  // namespace vramd::load
