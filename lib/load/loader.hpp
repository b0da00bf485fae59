// Loading a model from its config: build the architecture on the meta device, map checkpoint
// tensors to parameters (through the converter when there is one), then materialise each
// parameter straight into its device and dtype, one tensor at a time (weights/weights.hpp picks
// how they are held). Above both model/ and weights/, which it assembles.
#pragma once

#include "config/model_config.hpp"
#include "model/load_options.hpp"
#include "model/progress.hpp"
#include "weights/loaded_model.hpp"

namespace vramd::load {

// Throws Error naming the config and every missing, unexpected or mismatched key at once;
// model::Cancelled when the progress callback cancels it.
weights::LoadedModel load_model(const config::ModelConfig& config, const model::LoadOptions& options = {});

// Whole-model sleep: every weight to the offload state ("disk" releases them; they are re-read
// from the checkpoint through the converter's expressions when needed), the computation
// device freed. Wake: back to how load_model left them. Each reports the bytes moved.
model::Transition offload(weights::LoadedModel& loaded);
model::Transition onload(weights::LoadedModel& loaded);

}  // namespace vramd::load
