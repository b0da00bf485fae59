// The one block engine: a transformer of any family, built from a resolved blueprint
// (family/blueprint.hpp) on the meta device.
#pragma once

#include <memory>

#include "family/blueprint.hpp"
#include "model/model.hpp"

namespace vramd::model {

std::unique_ptr<Model> build_transformer(family::Blueprint blueprint, c10::ScalarType dtype);

}  // namespace vramd::model
