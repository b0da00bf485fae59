#include "convert/converter.hpp"

#include <lua.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>

#include "convert/lua_api.hpp"
#include "convert/lua_source.hpp"
#include "convert/lua_tensor.hpp"
#include "convert/sources.hpp"
#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/sort.hpp"
#include "util/utf8.hpp"

namespace vramd::convert {
namespace {

// A JSON value as Lua values: objects and arrays become tables, null becomes nil.
void push_json(lua_State* L, const nlohmann::json& value) {
  luaL_checkstack(L, 3, "JSON nested too deeply");
  switch (value.type()) {
    case nlohmann::json::value_t::object:
      lua_createtable(L, 0, static_cast<int>(value.size()));
      for (const auto& [key, item] : value.items()) {
        push_json(L, item);
        lua_setfield(L, -2, key.c_str());
      }
      break;
    case nlohmann::json::value_t::array:
      lua_createtable(L, static_cast<int>(value.size()), 0);
      for (size_t i = 0; i < value.size(); ++i) {
        push_json(L, value[i]);
        lua_rawseti(L, -2, static_cast<int>(i + 1));
      }
      break;
    case nlohmann::json::value_t::string: lua_pushstring(L, value.get_ref<const std::string&>().c_str()); break;
    case nlohmann::json::value_t::boolean: lua_pushboolean(L, value.get<bool>()); break;
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float: lua_pushnumber(L, value.get<double>()); break;
    default: lua_pushnil(L);
  }
}

std::string read_script(const std::string& path) { return read_regular_file(path, kMaxScriptBytes); }

}  // namespace

ConversionPlan run_converter(const std::string& script_path, const storage::DiskMap& map, const std::string& arch_json,
                             const SandboxLimits& limits) {
  return run_converter_code(read_script(script_path), script_path, map, arch_json, limits);
}

ConversionPlan run_converter_code(const std::string& code, const std::string& script_path, const storage::DiskMap& map,
                                  const std::string& arch_json, const SandboxLimits& limits) {
  LuaSandbox sandbox(limits);
  lua_State* L = sandbox.state();

  ConversionPlan plan;
  try {
    lua::install_tensors(L);
    lua::install_source(L, map);
    push_json(L, nlohmann::json::parse(arch_json));
    lua::set_global(L, "arch");
    sandbox.run(lua::kStringFunctions, "vramd rename", 0, 2);
    lua_setfield(L, LUA_REGISTRYINDEX, "vramd.gsub");
    lua_setfield(L, LUA_REGISTRYINDEX, "vramd.find");
    lua::install_rename(L);

    sandbox.run(code, script_path, 0, 1);  // [result]
  } catch (const Error& e) {
    std::string message = e.what();
    if (message.rfind(script_path, 0) != 0) message = script_path + ": " + message;
    throw Error(message);
  }
  plan.printed = sandbox.printed();

  if (!lua_istable(L, -1))
    fail(script_path, std::string("returned ") + luaL_typename(L, -1) +
                          ", not a table of target names to tensors");
  luaL_getmetatable(L, lua::kTensorType);  // [result, metatable]
  const int metatable = lua_gettop(L);
  lua_pushnil(L);  // [result, metatable, nil]
  while (lua_next(L, -3) != 0) {  // [result, metatable, key, value]
    if (lua_type(L, -2) != LUA_TSTRING)
      fail(script_path, std::string("returned a table with a ") + luaL_typename(L, -2) +
                            " key; target names are strings");
    const std::string_view name = lua::string_at(L, -2);
    if (!valid_utf8(name))
      fail(script_path, "target " + quote(name) + " is not valid UTF-8, as safetensors and vramd's replies need");
    const ExprPtr* value = lua::to_tensor(L, -1, metatable);
    if (!value) fail(script_path, "target " + quote(name) + " is a " + luaL_typename(L, -1) + ", not a tensor");
    plan.tensors.push_back({std::string(name), *value});
    lua_pop(L, 1);
  }
  lua_pop(L, 2);
  sort_by(plan.tensors, [](const Conversion& c) -> const std::string& { return c.target; });

  // Source keys no target reads.
  const auto tensors = map.tensors();
  std::vector<char> used(tensors.size());
  for (const auto& conversion : plan.tensors)
    conversion.expr->for_each_source([&](const Expr& source) { used[&map.at(source.source, source.shard) - tensors.data()] = 1; });
  // A name several files hold is used when any slice of it is: Meta's norms are whole in each.
  for (size_t i = 0; i < tensors.size();) {
    size_t end = i + 1;
    while (end < tensors.size() && tensors[end].shard > 0) ++end;
    if (std::none_of(used.begin() + i, used.begin() + end, [](char u) { return u != 0; }))
      plan.unused.emplace_back(tensors[i].name());
    i = end;
  }
  return plan;
}

ConversionPlan identity_plan(const storage::DiskMap& map) {
  ConversionPlan plan;
  for (const auto& info : map.tensors())
    if (!later_chunk(info)) plan.tensors.push_back({std::string(info.name()), whole_source(map, info)});
  return plan;
}

}  // namespace vramd::convert
