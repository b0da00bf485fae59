// The block engine's switches and weight slots: what a family file may set and name. One
// table, so that the parser, the blueprint and docs/architectures.md agree. Torch-free.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace vramd::family {

enum class Type { Integer, Number, Boolean, String, Strings, Integers, Object };

struct Switch {
  const char* name;
  Type type;
  std::vector<std::string_view> choices;  // Type::String: the values allowed (empty: any)
};

// nullptr for a name the engine does not have.
const Switch* find_switch(std::string_view name);
std::vector<std::string> switch_names();
std::vector<std::string> slot_names();
// "an integer", "one of \"rms\", \"layer\"": what the switch takes, for messages.
std::string type_text(const Switch& sw);
// Empty when `value` fits the switch; else what is wrong with it.
std::string type_problem(const Switch& sw, const nlohmann::json& value);

}  // namespace vramd::family
