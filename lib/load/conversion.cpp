#include "load/conversion.hpp"

#include <chrono>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "convert/chain.hpp"
#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/subprocess.hpp"

namespace vramd::load {

namespace {

// Importing transformers and building the model on the meta device takes seconds; a Python
// that hangs is killed after this.
constexpr std::chrono::seconds kRulesTimeout{300};
constexpr size_t kCached = 32;  // converters written, by their inputs

// The last line of what the Python wrote on standard error: its own message, or a traceback's
// exception.
std::string last_line(const std::string& text) {
  size_t end = text.find_last_not_of(" \n\r\t");
  if (end == std::string::npos) return "";
  const size_t start = text.rfind('\n', end);
  return text.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1) + 1);
}

// transformers' rules for config.json's model type over `keys`, as a converter's text, written by
// config.python (a later call with the same inputs reads it from memory).
std::string rules_text(const config::ModelConfig& config, const std::vector<std::string>& keys,
                       const hparams::Hyperparams& hyperparams) {
  const std::string where = config::where(config, "converter");
  const std::string what = "converter = \"transformers\": ";
  const nlohmann::json arch = nlohmann::json::parse(hyperparams.json());
  if (!arch.contains("model_type") || !arch["model_type"].is_string())
    fail(where, what + "transformers' rules are chosen by config.json's model_type: " +
                    (hyperparams.origin().starts_with("no ") ? hyperparams.origin()
                                                             : hyperparams.origin() + " has no model_type") +
                    " (save_pretrained writes a config.json that has one beside the checkpoint)");
  const std::string input = nlohmann::json{{"config", arch}, {"keys", keys}, {"where", hyperparams.origin()}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);

  static std::mutex mutex;
  static auto* written = new std::map<std::string, std::string>;  // never destroyed: no order at exit
  const std::string key = config.python + '\0' + input;
  {
    std::lock_guard lock(mutex);
    if (auto it = written->find(key); it != written->end()) return it->second;
  }
  const std::vector<std::string> argv = {config.python, "-m", "vramd.transformers_converter", "--stdin"};
  const std::string command = config.python + " -m vramd.transformers_converter";
  const std::string remedy = " (python in the daemon's config names a Python with vramd's package and transformers 5: "
                             "docs/config.md)";
  ProcessResult result;
  try {
    result = run_process(argv, input, kRulesTimeout, kMaxScriptBytes);
  } catch (const Error& e) {
    fail(where, what + e.what() + remedy);
  }
  if (result.timed_out)
    fail(where, what + command + " did not finish in " + std::to_string(kRulesTimeout.count()) + " s");
  if (result.too_much)
    fail(where, what + command + " wrote more than the " + format_bytes(kMaxScriptBytes) + " a converter may be");
  if (result.status != 0) {
    const std::string said = last_line(result.err);
    const bool missing = said.find("ModuleNotFoundError") != std::string::npos;
    fail(where, what + command + " failed (status " + std::to_string(result.status) + ")" +
                    (said.empty() ? "" : ": " + said) + (missing ? remedy : ""));
  }
  std::lock_guard lock(mutex);
  if (written->size() >= kCached) written->clear();
  return (*written)[key] = std::move(result.out);
}

}  // namespace

std::string transformers_converter(const config::ModelConfig& config, const storage::DiskMap& map,
                                   const hparams::Hyperparams& hyperparams) {
  std::vector<std::string> keys;
  if (config.converter_first.empty()) {
    for (const auto& tensor : map.tensors())  // a name in several files (shards) once
      if (keys.empty() || tensor.name() != keys.back()) keys.emplace_back(tensor.name());
    return rules_text(config, keys, hyperparams);
  }
  // A GGUF file: transformers' rules over the names gguf.lua makes of llama.cpp's.
  const std::string first = read_regular_file(config.converter_first, kMaxScriptBytes);
  for (const auto& tensor : convert::run_converter_code(first, config.converter_first, map, hyperparams.json()).tensors)
    keys.push_back(tensor.target);
  return convert::chained(config.converter_first, first, rules_text(config, keys, hyperparams));
}

convert::ConversionPlan conversion_plan(const config::ModelConfig& config, const storage::DiskMap& map,
                                        const hparams::Hyperparams& hyperparams) {
  if (config.converter.empty()) return convert::identity_plan(map);
  if (config.converter != config::kTransformersConverter)
    return convert::run_converter(config.converter, map, hyperparams.json());
  const std::string text = transformers_converter(config, map, hyperparams);
  try {
    return convert::run_converter_code(text, "the converter transformers' rules make", map, hyperparams.json());
  } catch (const Error& e) {
    fail(config::where(config, "converter"), std::string("converter = \"transformers\": ") + e.what());
  }
}

convert::ConversionPlan conversion_plan(const config::ModelConfig& config, const storage::DiskMap& map) {
  if (config.converter.empty()) return convert::identity_plan(map);
  return conversion_plan(config, map, hparams::Hyperparams::for_model(config, map));
}

}  // namespace vramd::load
