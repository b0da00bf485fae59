#include "convert/lua_source.hpp"

#include <algorithm>
#include <optional>

#include "convert/lua_api.hpp"
#include "convert/lua_pattern.hpp"
#include "convert/sources.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::convert::lua {
namespace {

// Raises "<what>: 2 files hold a slice of 'x' (a.pth, b.pth); ...", the script's line first.
int sharded_error(lua_State* L, const storage::DiskMap& map, const std::string& what, std::string_view name) {
  std::string files;
  const auto shards = map.shards(name);
  for (const auto& shard : shards) files += (files.empty() ? "" : ", ") + map.files()[shard.file].path;
  return luaL_error(L, "%s: %d files hold a slice of %s (%s); src:shards(name) gives each, for cat to join",
                    what.c_str(), static_cast<int>(shards.size()), quote(name).c_str(), files.c_str());
}

// The source checkpoint, as the script sees it.
struct Source {
  const storage::DiskMap* map;
};

Source& check_source(lua_State* L, int index) { return *static_cast<Source*>(luaL_checkudata(L, index, kSourceType)); }

void push_source_tensor(lua_State* L, const Source& source, const storage::TensorInfo& info, int metatable = 0) {
  guarded(L, [&] {
    push_tensor(L, whole_source(*source.map, info), metatable);
    return 0;
  });
}

// The tensor of that name, for src[name] and src:get(name); false when there is none.
bool push_source_tensor(lua_State* L, Source& source, const std::string& name, bool get) {
  const auto shards = source.map->shards(name);
  if (shards.size() > 1 && !shards.front().chunk)
    sharded_error(L, *source.map, get ? "src:get(" + quote(name) + ")" : "src[" + quote(name) + "]", name);
  if (!shards.empty()) push_source_tensor(L, source, shards.front());
  return !shards.empty();
}

int source_get(lua_State* L) {
  auto& source = check_source(L, 1);
  if (!push_source_tensor(L, source, luaL_checkstring(L, 2), true)) lua_pushnil(L);
  return 1;
}

int source_has(lua_State* L) {
  auto& source = check_source(L, 1);
  lua_pushboolean(L, source.map->find(luaL_checkstring(L, 2)) != nullptr);
  return 1;
}

// The number of names: a name several files hold counts once.
size_t name_count(const storage::DiskMap& map) {
  const auto tensors = map.tensors();
  return static_cast<size_t>(
      std::count_if(tensors.begin(), tensors.end(), [](const storage::TensorInfo& t) { return t.shard == 0; }));
}

int source_keys(lua_State* L) {
  auto& source = check_source(L, 1);
  lua_createtable(L, static_cast<int>(name_count(*source.map)), 0);
  int n = 0;
  for (const auto& tensor : source.map->tensors()) {
    if (tensor.shard > 0) continue;
    const auto name = tensor.name();
    lua_pushlstring(L, name.data(), name.size());
    lua_rawseti(L, -2, ++n);
  }
  return 1;
}

// src:shards(name): each file's slice of the name, in file order (one tensor when one file holds it).
int source_shards(lua_State* L) {
  auto& source = check_source(L, 1);
  const std::string name = luaL_checkstring(L, 2);
  const auto shards = source.map->shards(name);
  if (shards.empty())
    return luaL_error(L, "src:shards(%s): the checkpoint has no tensor of that name", quote(name).c_str());
  if (shards.front().chunk) {  // a DCP tensor: its chunks joined, as one slice
    lua_createtable(L, 1, 0);
    push_source_tensor(L, source, shards.front());
    lua_rawseti(L, -2, 1);
    return 1;
  }
  lua_createtable(L, static_cast<int>(shards.size()), 0);
  for (size_t i = 0; i < shards.size(); ++i) {
    push_tensor(L, source_of(shards[i], static_cast<uint32_t>(shards.size())));
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
  return 1;
}

int source_next(lua_State* L) {
  // upvalues: the source (checked by source_items), the position, the tensor metatable
  const auto& source = *static_cast<const Source*>(lua_touserdata(L, lua_upvalueindex(1)));
  auto position = static_cast<size_t>(lua_tonumber(L, lua_upvalueindex(2)));
  const auto tensors = source.map->tensors();
  while (position < tensors.size() && later_chunk(tensors[position])) ++position;
  if (position >= tensors.size()) return 0;
  if (sharded_at(tensors, position)) return sharded_error(L, *source.map, "src:items()", tensors[position].name());
  lua_pushnumber(L, static_cast<lua_Number>(position + 1));
  lua_replace(L, lua_upvalueindex(2));
  const auto name = tensors[position].name();
  lua_pushlstring(L, name.data(), name.size());
  push_source_tensor(L, source, tensors[position], lua_upvalueindex(3));
  return 2;
}

int source_items(lua_State* L) {
  check_source(L, 1);
  lua_pushvalue(L, 1);
  lua_pushnumber(L, 0);
  luaL_getmetatable(L, kTensorType);
  lua_pushcclosure(L, source_next, 3);
  return 1;
}

// The three source names nearest to `name`, quoted, for an error about a missing one.
std::string nearest_names(const storage::DiskMap& map, std::string_view name) {
  std::vector<std::pair<size_t, std::string_view>> scored;
  for (const auto& tensor : map.tensors()) {
    if (tensor.shard > 0) continue;
    const std::string_view candidate = tensor.name();
    const size_t gap = candidate.size() > name.size() ? candidate.size() - name.size() : name.size() - candidate.size();
    if (gap <= 16) scored.emplace_back(edit_distance(candidate, name), candidate);
  }
  const size_t shown = std::min<size_t>(3, scored.size());
  std::partial_sort(scored.begin(), scored.begin() + static_cast<std::ptrdiff_t>(shown), scored.end());
  std::string text;
  for (size_t i = 0; i < shown; ++i) text += (i ? ", " : "") + quote(scored[i].second);
  return text.empty() ? "none" : text;
}

int source_index(lua_State* L) {
  // [source, key]: a method, else the tensor of that name, else an error naming the nearest
  auto& source = check_source(L, 1);
  const std::string key = luaL_checkstring(L, 2);
  luaL_getmetatable(L, kSourceType);
  lua_getfield(L, -1, "methods");
  lua_getfield(L, -1, key.c_str());
  if (!lua_isnil(L, -1)) return 1;
  lua_pop(L, 3);
  if (push_source_tensor(L, source, key, false)) return 1;
  return luaL_error(L, "the checkpoint has no tensor %s (nearest: %s); src:get(name) gives nil for a name that may be missing",
                    quote(key).c_str(), nearest_names(*source.map, key).c_str());
}

int source_len(lua_State* L) {
  lua_pushnumber(L, static_cast<lua_Number>(name_count(*check_source(L, 1).map)));
  return 1;
}

// A rule of rename() or src:renamed(). Its pattern and replacement stay on the stack, at `slot`
// and slot + 1, for Lua's own functions when lua_gsub declines.
struct RenameRule {
  int number;  // from 1, for messages
  int slot;
  bool native;  // both strings: lua_gsub may do it
  std::string_view pattern, replacement;
};

// Pushes rule `number` of the table at `rules`, its pattern and its replacement (three slots;
// a caller that keeps several checks the stack's room first).
RenameRule push_rename_rule(lua_State* L, int rules, int number) {
  lua_rawgeti(L, rules, number);  // [rule]
  if (!lua_istable(L, -1))
    luaL_error(L, "rename rule %d is a %s, not a { pattern, replacement } table", number, luaL_typename(L, -1));
  lua_rawgeti(L, -1, 1);
  lua_rawgeti(L, -2, 2);  // [rule, pattern, replacement]
  if (lua_isnil(L, -2) || lua_isnil(L, -1))
    luaL_error(L, "rename rule %d has no %s; rules are { pattern, replacement }", number,
               lua_isnil(L, -2) ? "pattern" : "replacement");
  RenameRule rule{number, lua_gettop(L) - 1, lua_type(L, -2) == LUA_TSTRING && lua_type(L, -1) == LUA_TSTRING, {}, {}};
  if (rule.native) rule.pattern = string_at(L, rule.slot), rule.replacement = string_at(L, rule.slot + 1);
  return rule;
}

// Raises "<where>rename rule N (pattern '...'): <message>" at the caller's line.
int rule_error(lua_State* L, const RenameRule& rule, const std::string& message) {
  const char* pattern = lua_tostring(L, rule.slot);
  luaL_where(L, 1);
  lua_pushfstring(L, "rename rule %d (pattern %s): %s", rule.number, quote(pattern ? pattern : "nil").c_str(),
                  message.c_str());
  lua_concat(L, 2);
  return lua_error(L);
}

// One rule through Lua's own string.find and string.gsub (kept in the registry), which coerce
// numbers and name wrong arguments. Pushes the new name and returns true when the rule
// matches. An error names the rule.
bool rename_in_lua(lua_State* L, std::string_view name, const RenameRule& rule) {
  lua_getfield(L, LUA_REGISTRYINDEX, "vramd.find");
  lua_pushlstring(L, name.data(), name.size());
  lua_pushvalue(L, rule.slot);
  int status = lua_pcall(L, 2, 1, 0);  // find(name, pattern)
  if (status == 0) {
    const bool found = !lua_isnil(L, -1);
    lua_pop(L, 1);
    if (!found) return false;
    lua_getfield(L, LUA_REGISTRYINDEX, "vramd.gsub");
    lua_pushlstring(L, name.data(), name.size());
    lua_pushvalue(L, rule.slot);
    lua_pushvalue(L, rule.slot + 1);
    status = lua_pcall(L, 3, 1, 0);  // gsub(name, pattern, replacement)
    if (status == 0) return true;
  }
  // [..., message]: Lua's message without the location it gives, which is inside rename()
  std::string message = lua_tostring(L, -1) ? lua_tostring(L, -1) : "error";
  if (auto colon = message.find(": "); colon != std::string::npos && message.rfind(":", colon - 1) != std::string::npos)
    message.erase(0, colon + 2);
  rule_error(L, rule, message);
  return false;
}

// When `rule` matches `name`, pushes the new name (string.gsub's meaning) and returns true.
// lua_gsub does the work; what it declines, and patterns or replacements that are not
// strings, go to rename_in_lua. A pattern that backtracks without end is an error here, where
// Lua's matcher would run on past any time limit.
bool push_renamed(lua_State* L, std::string_view name, const RenameRule& rule) {
  if (rule.native) {
    std::optional<Substitution> result;
    try {
      result = lua_gsub(name, rule.pattern, rule.replacement);
    } catch (const PatternTooComplex&) {
      rule_error(L, rule, "pattern too complex: matching " + quote(name) + " took more than " +
                              std::to_string(kMaxPatternSteps) + " steps");
    }
    if (result) {
      if (result->count == 0) return false;
      lua_pushlstring(L, result->text.data(), result->text.size());
      return true;
    }
  }
  return rename_in_lua(L, name, rule);
}

// rename(name, rules): the new name by the first rule that matches, or nil when none does.
// Rules are read as they are tried: most names match one of the first.
int global_rename(lua_State* L) {
  lua_settop(L, 2);
  size_t size = 0;
  const char* name = luaL_checklstring(L, 1, &size);  // a number becomes its string, as string.gsub takes it
  luaL_checktype(L, 2, LUA_TTABLE);
  for (int i = 1, n = static_cast<int>(lua_objlen(L, 2)); i <= n; ++i) {
    lua_settop(L, 2);
    if (push_renamed(L, {name, size}, push_rename_rule(L, 2, i))) return 1;
  }
  lua_pushnil(L);
  return 1;
}

// src:renamed(rules): a table of every source tensor under its new name by rename()'s rules (a
// key no rule matches keeps its own), built in one call. Two keys that become one name are an
// error naming both.
int source_renamed(lua_State* L) {
  const auto& source = check_source(L, 1);
  if (!lua_istable(L, 2))
    return luaL_error(L, "src:renamed takes a table of { pattern, replacement } rules, not a %s", luaL_typename(L, 2));
  lua_settop(L, 2);
  std::vector<RenameRule> rules;
  const int n = static_cast<int>(lua_objlen(L, 2));
  luaL_checkstack(L, 3 * n + 8, "too many rename rules");
  for (int i = 1; i <= n; ++i) rules.push_back(push_rename_rule(L, 2, i));
  const auto tensors = source.map->tensors();
  lua_createtable(L, 0, static_cast<int>(tensors.size()));
  const int out = lua_gettop(L);
  luaL_getmetatable(L, kTensorType);
  const int metatable = out + 1;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& info = tensors[i];
    const auto name = info.name();
    if (later_chunk(info)) continue;
    if (sharded_at(tensors, i)) return sharded_error(L, *source.map, "src:renamed", name);
    if (std::none_of(rules.begin(), rules.end(), [&](const RenameRule& rule) { return push_renamed(L, name, rule); }))
      lua_pushlstring(L, name.data(), name.size());  // [..., target]
    lua_pushvalue(L, -1);
    lua_rawget(L, out);  // [..., target, earlier]
    if (!lua_isnil(L, -1)) {
      const auto& earlier = *static_cast<const ExprPtr*>(lua_touserdata(L, -1));
      return luaL_error(L, "src:renamed: %s and %s both become %s", quote(earlier->source).c_str(),
                        quote(name).c_str(), quote(string_at(L, -2)).c_str());
    }
    lua_pop(L, 1);
    push_source_tensor(L, source, info, metatable);
    lua_rawset(L, out);
  }
  lua_settop(L, out);
  return 1;
}

}  // namespace

void install_source(lua_State* L, const storage::DiskMap& map) {
  register_type(L, kSourceType, source_index,
                {{"get", source_get}, {"has", source_has}, {"keys", source_keys}, {"items", source_items},
                 {"shards", source_shards}, {"renamed", source_renamed}},
                {{"__len", source_len}});
  auto* memory = static_cast<Source*>(lua_newuserdata(L, sizeof(Source)));
  *memory = Source{&map};
  luaL_getmetatable(L, kSourceType);
  lua_setmetatable(L, -2);
  set_global(L, "src");
}

void install_rename(lua_State* L) {
  lua_pushcfunction(L, global_rename);
  set_global(L, "rename");
}

}  // namespace vramd::convert::lua
