#include "model/registry.hpp"

#include <map>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {

// Each architecture's file defines its builder; `name` is the registered name it was asked for.
using Builder = std::unique_ptr<Model> (*)(const std::string& name, const Hyperparams&, c10::ScalarType);
std::unique_ptr<Model> build_llama(const std::string&, const Hyperparams&, c10::ScalarType);
std::unique_ptr<Model> build_gpt2(const std::string&, const Hyperparams&, c10::ScalarType);
std::unique_ptr<Model> build_bert(const std::string&, const Hyperparams&, c10::ScalarType);

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

namespace {

struct Entry {
  const char* name;
  Builder build;
};

constexpr Entry kArchitectures[] = {
    {"llama", build_llama}, {"mistral", build_llama}, {"qwen2", build_llama},
    {"gpt2", build_gpt2},   {"bert", build_bert},
};

}  // namespace

std::string known_architectures() {
  std::string known;
  for (const auto& entry : kArchitectures) known += (known.empty() ? "" : ", ") + std::string(entry.name);
  return known + ", weights";
}

std::unique_ptr<Model> build_model(const std::string& architecture, const Hyperparams& hyperparams,
                                   c10::ScalarType dtype, const TensorShapes& tensors) {
  if (architecture == "weights") return std::make_unique<WeightsOnly>(tensors, dtype);
  for (const auto& entry : kArchitectures) {
    if (architecture != entry.name) continue;
    // Each family declares the model_type it computes. Another family's weights often have the
    // same names and shapes and would load without a word, then compute nonsense (Gemma's as
    // LLaMA: all-zero logits), so a checkpoint that says what it is is taken at its word.
    const std::string model_type = hyperparams.string("model_type", "");
    if (!model_type.empty() && model_type != entry.name)
      throw Error("the checkpoint's model_type is " + quote(model_type) + ", which architecture " + quote(architecture) +
                  " does not declare: it would compute another model. Leave architecture unset to use the "
                  "checkpoint's own (known: " + known_architectures() + "), or, if it truly is " +
                  quote(architecture) + ", say so with [arch] model_type = \"" + architecture + "\"");
    // Every missing hyperparameter at once: the family reads them all, missing ones as 1, and
    // any error that placeholder caused gives way to the list of what is missing.
    const Hyperparams reading = hyperparams.collecting();
    std::unique_ptr<Model> model;
    try {
      model = entry.build(architecture, reading, dtype);
    } catch (...) {
      reading.check_complete();
      throw;
    }
    reading.check_complete();
    return model;
  }
  throw Error("unknown architecture " + quote(architecture) + " (known: " + known_architectures() + ")");
}

}  // namespace vramd::model
