// A loaded model: the model, what its load reported, the checkpoint and expressions its weights
// come from, and the weights (weights/weights.hpp). What load::load_model returns, and what the
// daemon's runtime, a lease's memory and vramctl run hold.
#pragma once

#include <memory>

#include "model/load_report.hpp"
#include "model/model.hpp"

namespace vramd::weights {

class SharedRegion;
struct Source;
struct WeightUpdate;
class Weights;

struct LoadedModel {
  std::unique_ptr<model::Model> model;
  model::LoadReport report;
  std::shared_ptr<Source> source;    // the checkpoint and the expressions that fill each parameter
  std::shared_ptr<Weights> weights;  // where they are and how ops get them (weights/weights.hpp)
};

}  // namespace vramd::weights
