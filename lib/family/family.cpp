#include "family/family.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "config/toml_schema.hpp"
#include "family/switches.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::family {
namespace {

using Json = nlohmann::json;

// A TOML value as JSON: scalars, and arrays of them (layer_types).
std::optional<Json> to_json(const toml::node& node) {
  if (auto v = node.as_boolean()) return Json(v->get());
  if (auto v = node.as_integer()) return Json(v->get());
  if (auto v = node.as_floating_point()) return Json(v->get());
  if (auto v = node.as_string()) return Json(v->get());
  if (auto array = node.as_array()) {
    Json out = Json::array();
    for (const auto& item : *array) {
      auto value = to_json(item);
      if (!value || value->is_array()) return std::nullopt;
      out.push_back(std::move(*value));
    }
    return out;
  }
  return std::nullopt;
}

class Parser {
 public:
  Parser(Family& family, config::Problems& problems) : family_(family), problems_(problems) {}

  void root(config::TableReader& root) {
    family_.summary = root.string("summary").value_or("");
    family_.extends = root.string("extends").value_or("");
    if (auto types = root.strings("model_types")) family_.model_types = *types;
    else root.problem("model_types: missing (the config.json model_type values this family computes)");
    family_.base_prefix = root.string("base_prefix").value_or("");
    family_.ignored = root.strings("ignore").value_or(std::vector<std::string>{});
    family_.optional = root.strings("optional").value_or(std::vector<std::string>{});
    family_.embedding_order = root.strings("embedding_order").value_or(std::vector<std::string>{});
    for (size_t i = 0; i < family_.embedding_order.size(); ++i) {
      const std::string& slot = family_.embedding_order[i];
      if (std::find(kEmbeddingSlots.begin(), kEmbeddingSlots.end(), slot) == kEmbeddingSlots.end())
        root.bad_value("embedding_order", quote(slot) + " is not an embedding slot (embed_tokens, embed_positions, "
                                                        "embed_types, embed_norm)");
      else if (std::find(family_.embedding_order.begin(), family_.embedding_order.begin() + i, slot) !=
               family_.embedding_order.begin() + i)
        root.bad_value("embedding_order", "names " + quote(slot) + " twice");
    }
    if (auto table = root.table("hyperparameters")) hyperparameters(*table);
    if (auto table = root.table("switches")) switches(*table);
    if (auto table = root.table("names")) names(*table);
    else if (family_.extends.empty()) root.problem("names: missing (which module names hold which weights)");
    if (auto table = root.table("requires")) requirements(*table);
    for (const auto& slot : family_.optional)
      if (!family_.names.count(slot)) root.bad_value("optional", "names the slot " + quote(slot) + ", which [names] lacks");
    root.finish();
  }

 private:
  // A value of switch `name`'s type, or a problem reported against `key` of `table`.
  std::optional<JsonText> typed(config::TableReader& table, std::string_view key, const Switch& sw, const toml::node& node,
                                const std::string& what) {
    auto value = to_json(node);
    std::string problem;
    if (!value || !(problem = type_problem(sw, *value)).empty()) {
      table.bad_value(key, what + ": " + (problem.empty() ? std::string("expected ") + type_text(sw) : problem));
      return std::nullopt;
    }
    return value->dump();
  }

  const Switch* known_switch(config::TableReader& table, std::string_view key) {
    const Switch* sw = find_switch(key);
    if (sw) return sw;
    std::vector<std::string> names = switch_names();
    std::vector<std::string_view> views(names.begin(), names.end());
    const auto near = did_you_mean(key, views);
    table.bad_value(key, "no such switch of the engine" + (near ? "; did you mean " + quote(*near) + "?" : std::string()) +
                             " (docs/architectures.md lists them)");
    return nullptr;
  }

  bool fresh(config::TableReader& table, std::string_view key) {
    if (!family_.switches.count(std::string(key))) return true;
    table.bad_value(key, "set in both [hyperparameters] and [switches]");
    return false;
  }

  void hyperparameters(config::TableReader& table) {
    for (const auto key : table.keys()) {
      const toml::node* node = table.node(key);
      const Switch* sw = known_switch(table, key);
      if (!sw) continue;
      SwitchSource source;
      source.line = node->source().begin.line;
      if (node->is_string() || node->is_array()) {
        auto keys = table.strings(key);
        if (!keys) continue;
        source.keys = *keys;
      } else if (const auto* inline_table = node->as_table()) {
        config::TableReader spec(*inline_table, table.qualified(key), problems_);
        if (auto one = spec.string("key")) source.keys = {*one};
        if (auto many = spec.strings("keys")) source.keys = *many;
        if (source.keys.empty()) spec.problem(table.qualified(key) + ": give key = \"...\" or keys = [...]");
        if (const toml::node* fallback = spec.node("default")) source.fallback = typed(spec, "default", *sw, *fallback, "the default");
        source.required = spec.boolean("required").value_or(false);
        source.only_if = spec.string("if").value_or("");
        if (source.required && source.fallback) spec.bad_value("required", "a required key has no default");
        if (auto map = spec.table("map"))
          for (const auto from : map->keys())
            if (auto to = typed(*map, from, *sw, *map->node(from), "a mapped value")) source.mapped[std::string(from)] = *to;
        spec.finish();
      } else {
        table.bad_value(key, "expected a config.json key, a list of keys, or { key = ..., default = ..., map = {...} }");
        continue;
      }
      family_.switches[std::string(key)] = std::move(source);
    }
  }

  void switches(config::TableReader& table) {
    for (const auto key : table.keys()) {
      const toml::node* node = table.node(key);
      const Switch* sw = known_switch(table, key);
      if (!sw || !fresh(table, key)) continue;
      if (auto value = typed(table, key, *sw, *node, "the value")) {
        family_.switches[std::string(key)] = SwitchSource{.fixed = *value, .line = node->source().begin.line};
      }
    }
  }

  void names(config::TableReader& table) {
    const auto slots = slot_names();
    std::vector<std::string_view> views(slots.begin(), slots.end());
    for (const auto key : table.keys()) {
      const toml::node* node = table.node(key);
      if (std::find(slots.begin(), slots.end(), key) == slots.end()) {
        const auto near = did_you_mean(key, views);
        table.bad_value(key, "no such slot" + (near ? "; did you mean " + quote(*near) + "?" : std::string()) +
                                 " (docs/architectures.md lists them)");
        continue;
      }
      NameSource name{.line = node->source().begin.line};
      if (node->is_string()) {
        name.name = *table.string(key);
      } else if (const auto* inline_table = node->as_table()) {
        config::TableReader choice(*inline_table, table.qualified(key), problems_);
        name.condition = choice.string("if").value_or("");
        name.name = choice.string("then").value_or("");
        name.otherwise = choice.string("else").value_or("");
        const Switch* sw = find_switch(name.condition);
        if (!sw || sw->type != Type::Boolean)
          choice.bad_value("if", "expected the name of a boolean switch, such as \"mlp_gated\"");
        if (name.name.empty() || name.otherwise.empty()) choice.problem(table.qualified(key) + ": give both then and else");
        choice.finish();
      } else {
        table.bad_value(key, "expected a module name, or { if = \"switch\", then = \"...\", else = \"...\" }");
        continue;
      }
      family_.names[std::string(key)] = std::move(name);
    }
    if (family_.names.count("layer") && family_.names["layer"].name.find("{i}") == std::string::npos)
      table.bad_value("layer", "must hold {i}");
    if (family_.names.count("expert") && !family_.names["expert"].name.empty() &&
        family_.names["expert"].name.find("{e}") == std::string::npos)
      table.bad_value("expert", "must hold {e}");
  }

  void requirements(config::TableReader& table) {
    for (const auto key : table.keys()) {
      const toml::node* node = table.node(key);
      auto value = to_json(*node);
      if (!value) {
        table.bad_value(key, "expected a value or a list of the values config.json may hold");
        continue;
      }
      auto& allowed = family_.required_values[std::string(key)];
      if (value->is_array())
        for (const auto& item : *value) allowed.push_back(item.dump());
      else
        allowed.push_back(value->dump());
    }
  }

  Family& family_;
  config::Problems& problems_;
};

}  // namespace

Family parse_family(const std::string& name, const std::string& text, const std::string& origin) {
  config::Problems problems(origin);
  Family family;
  family.name = name;
  family.origin = origin;
  auto document = config::parse_toml_text(text, origin, problems);
  if (document) {
    config::TableReader root(*document, "", problems);
    Parser(family, problems).root(root);
  }
  if (document && family.extends.empty() && !family.names.count("layer"))
    problems.add_whole_file(origin + ": names.layer: missing (the module of layer {i}, e.g. \"model.layers.{i}\")");
  problems.throw_if_any();
  return family;
}

Family inherit(const Family& base, const Family& derived) {
  Family family = base;
  family.name = derived.name;
  family.origin = derived.origin;
  family.summary = derived.summary;
  family.extends = derived.extends;
  family.model_types = derived.model_types;
  if (!derived.base_prefix.empty()) family.base_prefix = derived.base_prefix;
  family.ignored.insert(family.ignored.end(), derived.ignored.begin(), derived.ignored.end());
  for (const auto& [key, source] : derived.switches) family.switches[key] = source;
  for (const auto& [slot, name] : derived.names) family.names[slot] = name;
  for (const auto& slot : derived.optional)
    if (std::find(family.optional.begin(), family.optional.end(), slot) == family.optional.end()) family.optional.push_back(slot);
  if (!derived.embedding_order.empty()) family.embedding_order = derived.embedding_order;
  for (const auto& [key, values] : derived.required_values) family.required_values[key] = values;
  std::erase_if(family.required_values, [](const auto& entry) { return entry.second.empty(); });  // [] lifts one
  std::erase_if(family.names, [](const auto& entry) { return entry.second.name.empty() && entry.second.condition.empty(); });
  return family;
}

}  // namespace vramd::family
