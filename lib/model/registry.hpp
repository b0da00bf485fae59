// Architectures to models: a family (family/catalog.hpp) resolved against the checkpoint's
// hyperparameters and built by the block engine, or "weights" for a checkpoint served only as
// leases.
#pragma once

#include <memory>
#include <string>

#include "family/catalog.hpp"
#include "hparams/hyperparams.hpp"
#include "model/model.hpp"

namespace vramd::model {

using TensorShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// Builds the model on the meta device: shapes and names only, no memory, no initialisation.
// `architecture` is a family's name, a family file (".toml"), "weights", or empty for the
// family that declares the checkpoint's model_type. `tensors` are the checkpoint's, as the
// converter names them: the "weights" architecture holds one parameter each and has no
// forward (for leases, so that any architecture PyTorch can express gets its weights from
// vramd), and a family's optional modules exist when they hold their weights. Throws Error for
// unknown names, a family that does not declare the checkpoint's model_type, and
// hyperparameters that are missing (all named at once) or unsupported.
std::unique_ptr<Model> build_model(const std::string& architecture, const hparams::Hyperparams& hyperparams,
                                   c10::ScalarType dtype, const TensorShapes& tensors = {},
                                   const family::Catalog& families = family::Catalog());

}  // namespace vramd::model
