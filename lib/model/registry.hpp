// Architecture names to builders. Adding a family: one file with its builder, one line in
// registry.cpp's table.
#pragma once

#include <memory>
#include <string>

#include "model/hyperparams.hpp"
#include "model/model.hpp"

namespace vramd::model {

using TensorShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// Builds the model on the meta device: shapes and names only, no memory, no initialisation.
// `architecture` is a name from known_architectures(); throws Error for unknown names and for
// hyperparameters that are missing or unsupported. `tensors` (the checkpoint's, as the
// converter names them) make the "weights" architecture: one parameter each and no forward,
// for leases, so that any architecture PyTorch can express gets its weights from vramd.
std::unique_ptr<Model> build_model(const std::string& architecture, const Hyperparams& hyperparams,
                                   c10::ScalarType dtype, const TensorShapes& tensors = {});

// "llama, mistral, qwen2, gpt2, bert, weights": the names, for messages.
std::string known_architectures();

}  // namespace vramd::model
