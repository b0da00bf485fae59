#include "hparams/hyperparams.hpp"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "config/model_config.hpp"
#include "hparams/gguf_config.hpp"
#include "hparams/meta_params.hpp"
#include "storage/disk_map.hpp"
#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::hparams {
namespace fs = std::filesystem;
using Json = nlohmann::json;

struct Hyperparams::Impl {
  Json values;
  std::string origin;
  std::string path;  // of a nested object, for names: "rope_parameters."
  std::shared_ptr<std::vector<std::string>> missing;  // collecting: what was asked for and absent
};

namespace {

Json parse_json(const std::string& text, const std::string& origin) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    fail(origin, "not valid JSON: " + escape_invalid_utf8(e.what()));
  }
}

Json parse_object(const std::string& text, const std::string& origin) {
  Json value = parse_json(text, origin);
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

// The field `key` of `object`, or null where it has none; one of another type than `type` is
// refused naming `origin`.
const Json* field(const Json& object, const char* key, Json::value_t type, const std::string& origin) {
  const auto found = object.find(key);
  if (found == object.end()) return nullptr;
  if (found->type() != type)
    fail(origin, quote(key) + " is " + found->type_name() + ", not " + Json(type).type_name());
  return &*found;
}

// sentence-transformers keeps its pooling in modules.json and <module>/config.json.
void read_sentence_transformers(const fs::path& folder, Json& values) {
  const fs::path modules_path = folder / "modules.json";
  if (!present(modules_path)) return;
  const Json modules = parse_json(read_regular_file(modules_path.string(), kMaxJsonBytes), modules_path.string());
  if (!modules.is_array()) fail(modules_path.string(), "expected a JSON array of modules");
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string origin = modules_path.string() + ": module " + std::to_string(i);
    if (!modules[i].is_object()) fail(origin + " is " + modules[i].type_name(), "expected an object");
    const Json* type_field = field(modules[i], "type", Json::value_t::string, origin);
    const std::string type = type_field ? type_field->get<std::string>() : "";
    if (type.ends_with(".Normalize")) values["normalize"] = true;
    if (!type.ends_with(".Pooling")) continue;
    const Json* module = field(modules[i], "path", Json::value_t::string, origin);
    const fs::path pooling_path = folder / (module ? module->get<std::string>() : "") / "config.json";
    const Json pooling = read_json_file(pooling_path);
    for (const auto& [mode, key] : {std::pair{"mean", "pooling_mode_mean_tokens"},
                                    {"cls", "pooling_mode_cls_token"},
                                    {"max", "pooling_mode_max_tokens"}})
      if (const Json* on = field(pooling, key, Json::value_t::boolean, pooling_path.string()); on && on->get<bool>())
        values["pooling"] = mode;
  }
}

}  // namespace

Hyperparams::Hyperparams(const std::string& text, std::string origin)
    : impl_(std::make_shared<Impl>(Impl{parse_object(text, origin), std::move(origin), {}, {}})) {}

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
  return Hyperparams(std::make_shared<Impl>(Impl{std::move(values), std::move(origin), {}, {}}));
}

Hyperparams Hyperparams::for_model(const config::ModelConfig& config, const storage::DiskMap& map) {
  const auto& first = map.files()[0];
  const fs::path folder = fs::path(first.path).parent_path();
  // A "weights" model of a GGUF file's own names needs none of its metadata (and its
  // general.architecture may be any model's).
  if (first.format == storage::FileFormat::Gguf && (config.architecture != "weights" || !config.converter.empty()))
    return for_checkpoint(folder.string(), config.arch_json, config.path, gguf_config_json(map),
                          "the GGUF metadata of " + first.path);
  // Meta's own folders have params.json where Hugging Face's have config.json.
  if (const fs::path params = folder / "params.json"; !present(folder / "config.json") && present(params)) {
    const bool rope_scaling = parse_object(config.arch_json, config.path + " [arch]").contains("rope_scaling");
    return for_checkpoint(folder.string(), config.arch_json, config.path,
                          meta_params_json(read_json_file(params), params.string(), map, rope_scaling),
                          params.string());
  }
  return for_checkpoint(folder.string(), config.arch_json, config.path, "", "");
}

namespace {

const Json* find(const Json& values, std::string_view key) {
  auto it = values.find(key);
  return it == values.end() || it->is_null() ? nullptr : &*it;
}

// "'n_embd' (an integer)" -> "missing hyperparameter 'n_embd' (an integer; set it in config.json or [arch])"
std::string missing_one(const std::string& name) {
  return "missing hyperparameter " + name.substr(0, name.size() - 1) + "; set it in config.json or [arch])";
}

[[noreturn]] void wrong_type(const std::string& origin, std::string_view key, const char* expected, const Json& found) {
  fail(origin, "hyperparameter " + quote(key) + " must be " + expected + ", found " + found.dump());
}

}  // namespace

bool Hyperparams::has(std::string_view key) const { return find(impl_->values, key) != nullptr; }

// A required key is absent: an Error, or (collecting) a note, and the caller goes on with 1.
static void note_missing(const auto& impl, std::string_view key, const char* what) {
  const std::string name = quote(impl.path + std::string(key)) + " (" + what + ")";
  if (!impl.missing) fail(impl.origin, missing_one(name));
  if (std::find(impl.missing->begin(), impl.missing->end(), name) == impl.missing->end()) impl.missing->push_back(name);
}

int64_t Hyperparams::integer(std::string_view key) const {
  const Json* value = find(impl_->values, key);
  if (!value) {
    note_missing(*impl_, key, "an integer");
    return 1;
  }
  if (!value->is_number_integer()) wrong_type(impl_->origin, impl_->path + std::string(key), "an integer", *value);
  return value->get<int64_t>();
}

int64_t Hyperparams::integer(std::string_view key, int64_t fallback) const {
  return has(key) ? integer(key) : fallback;
}

double Hyperparams::number(std::string_view key) const {
  const Json* value = find(impl_->values, key);
  if (!value) {
    note_missing(*impl_, key, "a number");
    return 1.0;
  }
  if (!value->is_number()) wrong_type(impl_->origin, impl_->path + std::string(key), "a number", *value);
  return value->get<double>();
}

double Hyperparams::number(std::string_view key, double fallback) const { return has(key) ? number(key) : fallback; }

bool Hyperparams::boolean(std::string_view key, bool fallback) const {
  const Json* value = find(impl_->values, key);
  if (!value) return fallback;
  if (!value->is_boolean()) wrong_type(impl_->origin, impl_->path + std::string(key), "true or false", *value);
  return value->get<bool>();
}

std::string Hyperparams::string(std::string_view key, std::string fallback) const {
  const Json* value = find(impl_->values, key);
  if (!value) return fallback;
  if (!value->is_string()) wrong_type(impl_->origin, impl_->path + std::string(key), "a string", *value);
  return value->get<std::string>();
}

Hyperparams Hyperparams::object(std::string_view key) const {
  const Json* value = find(impl_->values, key);
  if (value && !value->is_object()) wrong_type(impl_->origin, impl_->path + std::string(key), "an object", *value);
  return Hyperparams(std::make_shared<Impl>(Impl{value ? *value : Json::object(), impl_->origin,
                                                impl_->path + std::string(key) + ".", impl_->missing}));
}

Hyperparams Hyperparams::collecting() const {
  auto impl = std::make_shared<Impl>(*impl_);
  impl->missing = std::make_shared<std::vector<std::string>>();
  return Hyperparams(std::move(impl));
}

void Hyperparams::require(bool holds, const std::string& message) const {
  if (!holds && !(impl_->missing && !impl_->missing->empty())) fail(impl_->origin, message);
}

void Hyperparams::check_complete() const {
  if (!impl_->missing || impl_->missing->empty()) return;
  const auto& missing = *impl_->missing;
  std::string names;
  for (const auto& name : missing) names += (names.empty() ? "" : ", ") + name;
  if (missing.size() == 1) fail(impl_->origin, missing_one(names));
  fail(impl_->origin, std::to_string(missing.size()) + " missing hyperparameters: " + names +
                          "; set them in config.json or [arch]");
}

std::string Hyperparams::json() const { return impl_->values.dump(); }
const std::string& Hyperparams::origin() const { return impl_->origin; }

}  // namespace vramd::hparams
