#include "model/registry.hpp"

#include <map>

#include "family/blueprint.hpp"
#include "model/engine.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {
namespace {

class WeightsOnly : public Model {
 public:
  WeightsOnly(const TensorShapes& checkpoint, c10::ScalarType dtype) : Model("weights", dtype, "", {}) {
    // One layer per prefix ("down.0.conv" holds "down.0.conv.weight" and ".bias").
    std::map<std::string, TensorShapes> layers;
    for (const auto& [name, shape] : checkpoint) {
      const auto dot = name.rfind('.');
      const std::string path = dot == std::string::npos ? "" : name.substr(0, dot);
      layers[path].emplace_back(dot == std::string::npos ? name : name.substr(dot + 1), shape);
    }
    for (auto& [path, shapes] : layers) tensors(path, std::move(shapes));
  }

  storage::NamedTensors forward(const storage::NamedTensors&) override {
    throw Error("architecture \"weights\" has no forward: it holds a checkpoint's tensors for leases "
                "(POST /v1/models/NAME/lease; the Python package's lease())");
  }
};

}  // namespace

std::unique_ptr<Model> build_model(const std::string& architecture, const hparams::Hyperparams& hyperparams,
                                   c10::ScalarType dtype, const TensorShapes& tensors, const family::Catalog& families) {
  if (architecture == "weights") return std::make_unique<WeightsOnly>(tensors, dtype);
  const std::string model_type = hyperparams.string("model_type", "");
  const auto family = architecture.empty() ? families.for_model_type(model_type) : families.named(architecture);
  // Each family declares the model_types it computes. Another family's weights often have the
  // same names and shapes and would load without a word, then compute nonsense (Gemma's as
  // LLaMA: all-zero logits), so a checkpoint that says what it is is taken at its word.
  const auto& declared = family->model_types;
  if (!model_type.empty() && std::find(declared.begin(), declared.end(), model_type) == declared.end())
    throw Error("the checkpoint's model_type is " + quote(model_type) + ", which architecture " + quote(family->name) +
                " does not declare: it would compute another model. Leave architecture unset to use the "
                "checkpoint's own (known: " + families.names() + "), or, if it truly is " + quote(family->name) +
                ", say so with [arch] model_type = \"" + declared.front() + "\"");
  std::vector<std::string> names;
  names.reserve(tensors.size());
  for (const auto& [name, shape] : tensors) names.push_back(name);
  // Every missing hyperparameter at once: the blueprint reads them all, missing ones as 1, and
  // any error that placeholder caused gives way to the list of what is missing.
  const hparams::Hyperparams reading = hyperparams.collecting();
  family::Blueprint blueprint;
  try {
    blueprint = family::resolve(*family, reading, names);
  } catch (...) {
    reading.check_complete();
    throw;
  }
  reading.check_complete();
  return build_transformer(std::move(blueprint), dtype);
}

}  // namespace vramd::model
