// Architecture names to builders. Adding a family: one file with its builder, one line in
// registry.cpp's table.
#pragma once

#include <memory>
#include <string>

#include "model/hyperparams.hpp"
#include "model/model.hpp"

namespace vramd::model {

// Builds the model on the meta device: shapes and names only, no memory, no initialisation.
// `architecture` is a name from known_architectures(); throws Error for unknown names and for
// hyperparameters that are missing or unsupported.
std::unique_ptr<Model> build_model(const std::string& architecture, const Hyperparams& hyperparams,
                                   c10::ScalarType dtype);

// "llama, mistral, qwen2, gpt2, bert": the registered names, for messages.
std::string known_architectures();

}  // namespace vramd::model
