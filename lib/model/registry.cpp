#include "model/registry.hpp"

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {

// Each architecture's file defines its builder; `name` is the registered name it was asked for.
using Builder = std::unique_ptr<Model> (*)(const std::string& name, const Hyperparams&, c10::ScalarType);
std::unique_ptr<Model> build_llama(const std::string&, const Hyperparams&, c10::ScalarType);
std::unique_ptr<Model> build_gpt2(const std::string&, const Hyperparams&, c10::ScalarType);
std::unique_ptr<Model> build_bert(const std::string&, const Hyperparams&, c10::ScalarType);

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
  return known;
}

std::unique_ptr<Model> build_model(const std::string& architecture, const Hyperparams& hyperparams,
                                   c10::ScalarType dtype) {
  for (const auto& entry : kArchitectures)
    if (architecture == entry.name) return entry.build(architecture, hyperparams, dtype);
  throw Error("unknown architecture " + quote(architecture) + " (known: " + known_architectures() + ")");
}

}  // namespace vramd::model
