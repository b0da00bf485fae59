#include "model/hyperparams.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"

namespace vramd::model {
namespace fs = std::filesystem;
using Json = nlohmann::json;

struct Hyperparams::Impl {
  Json values;
  std::string origin;
};

namespace {

Json parse_object(const std::string& text, const std::string& origin) {
  Json value;
  try {
    value = Json::parse(text);
  } catch (const Json::exception& e) {
    fail(origin, std::string("not valid JSON: ") + e.what());
  }
  if (!value.is_object()) fail(origin, "expected a JSON object");
  return value;
}

Json read_json_file(const fs::path& path) {
  return parse_object(read_regular_file(path.string(), kMaxJsonBytes), path.string());
}

// Whether anything, a file or not, is at `path`: what is there but cannot be read is refused by
// read_regular_file, naming what it is, rather than taken for absent.
bool present(const fs::path& path) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(path, ec));
}

// sentence-transformers keeps its pooling in modules.json and <module>/config.json.
void read_sentence_transformers(const fs::path& folder, Json& values) {
  const fs::path modules_path = folder / "modules.json";
  if (!present(modules_path)) return;
  const std::string text = read_regular_file(modules_path.string(), kMaxJsonBytes);
  Json modules;
  try {
    modules = Json::parse(text);
  } catch (const Json::exception& e) {
    fail(modules_path.string(), std::string("not valid JSON: ") + e.what());
  }
  if (!modules.is_array()) fail(modules_path.string(), "expected a JSON array of modules");
  for (const auto& module : modules) {
    const std::string type = module.value("type", "");
    if (type.ends_with(".Normalize")) values["normalize"] = true;
    if (!type.ends_with(".Pooling")) continue;
    const Json pooling = read_json_file(folder / module.value("path", "") / "config.json");
    for (const auto& [mode, key] : {std::pair{"mean", "pooling_mode_mean_tokens"},
                                    {"cls", "pooling_mode_cls_token"},
                                    {"max", "pooling_mode_max_tokens"}})
      if (pooling.value(key, false)) values["pooling"] = mode;
  }
}

}  // namespace

Hyperparams::Hyperparams(const std::string& text, std::string origin)
    : impl_(std::make_shared<Impl>(Impl{parse_object(text, origin), std::move(origin)})) {}

Hyperparams Hyperparams::for_checkpoint(const std::string& folder, const std::string& overrides_json,
                                        const std::string& config_path, const std::string& own_json,
                                        const std::string& own_origin) {
  const fs::path config_json = fs::path(folder) / "config.json";
  Json values = Json::object();
  std::string origin;
  if (!own_json.empty()) {
    values = parse_object(own_json, own_origin);
    origin = own_origin;
  } else if (present(config_json)) {
    values = read_json_file(config_json);
    origin = config_json.string();
  }
  read_sentence_transformers(folder, values);
  const Json overrides = parse_object(overrides_json, config_path + " [arch]");
  if (!overrides.empty()) {
    values.merge_patch(overrides);
    origin += (origin.empty() ? "" : " and ") + config_path + " [arch]";
  }
  if (origin.empty()) origin = "no config.json in " + folder + " and no [arch] in " + config_path;
  return Hyperparams(std::make_shared<Impl>(Impl{std::move(values), std::move(origin)}));
}

namespace {

const Json* find(const Json& values, std::string_view key) {
  auto it = values.find(key);
  return it == values.end() || it->is_null() ? nullptr : &*it;
}

[[noreturn]] void wrong_type(const std::string& origin, std::string_view key, const char* expected, const Json& found) {
  fail(origin, "hyperparameter " + quote(key) + " must be " + expected + ", found " + found.dump());
}

}  // namespace

bool Hyperparams::has(std::string_view key) const { return find(impl_->values, key) != nullptr; }

int64_t Hyperparams::integer(std::string_view key) const {
  const Json* value = find(impl_->values, key);
  if (!value) fail(impl_->origin, "missing hyperparameter " + quote(key) + " (an integer; set it in config.json or [arch])");
  if (!value->is_number_integer()) wrong_type(impl_->origin, key, "an integer", *value);
  return value->get<int64_t>();
}

int64_t Hyperparams::integer(std::string_view key, int64_t fallback) const {
  return has(key) ? integer(key) : fallback;
}

double Hyperparams::number(std::string_view key) const {
  const Json* value = find(impl_->values, key);
  if (!value) fail(impl_->origin, "missing hyperparameter " + quote(key) + " (a number; set it in config.json or [arch])");
  if (!value->is_number()) wrong_type(impl_->origin, key, "a number", *value);
  return value->get<double>();
}

double Hyperparams::number(std::string_view key, double fallback) const { return has(key) ? number(key) : fallback; }

bool Hyperparams::boolean(std::string_view key, bool fallback) const {
  const Json* value = find(impl_->values, key);
  if (!value) return fallback;
  if (!value->is_boolean()) wrong_type(impl_->origin, key, "true or false", *value);
  return value->get<bool>();
}

std::string Hyperparams::string(std::string_view key, std::string fallback) const {
  const Json* value = find(impl_->values, key);
  if (!value) return fallback;
  if (!value->is_string()) wrong_type(impl_->origin, key, "a string", *value);
  return value->get<std::string>();
}

Hyperparams Hyperparams::object(std::string_view key) const {
  const Json* value = find(impl_->values, key);
  if (value && !value->is_object()) wrong_type(impl_->origin, key, "an object", *value);
  return Hyperparams(std::make_shared<Impl>(Impl{value ? *value : Json::object(), impl_->origin + " " + std::string(key)}));
}

std::string Hyperparams::json() const { return impl_->values.dump(); }
const std::string& Hyperparams::origin() const { return impl_->origin; }

}  // namespace vramd::model
