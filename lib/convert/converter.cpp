#include "convert/converter.hpp"

#include "convert/lua_pattern.hpp"

#include <lua.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <optional>

#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/sort.hpp"
#include "util/utf8.hpp"

namespace vramd::convert {
namespace {

constexpr const char* kTensorType = "vramd.Tensor";
constexpr const char* kSourceType = "vramd.Source";

// A checkpoint tensor as an expression, the slice `info.shard` of `shards`; GGUF's block types
// read as float32 (load_tensor unpacks).
ExprPtr source_of(const storage::TensorInfo& info, uint32_t shards = 1) {
  const auto dtype = storage::dtype_block(info.dtype) == 1 ? info.dtype : storage::DType::F32;
  return source(std::string(info.name()), dtype, info.shape, info.shard, shards);
}

// Whether tensors[i] is the first of a name several files hold (not chunks: those are joined).
bool sharded_at(std::span<const storage::TensorInfo> tensors, size_t i) {
  return !tensors[i].chunk && i + 1 < tensors.size() && tensors[i + 1].shard > 0 &&
         tensors[i + 1].name() == tensors[i].name();
}

// Whether the tensor is a DCP chunk after its name's first, which whole_source joins in.
bool later_chunk(const storage::TensorInfo& info) { return info.chunk && info.shard > 0; }

// Chunks that tile a box joined into it: split along the first dimension from `dim` on in
// which they lie at several offsets, each slab joined along the next, then cat. The chunks of
// DTensor placements (FSDP's rows, tensor parallelism's columns) form such a grid.
ExprPtr join_chunks(std::vector<const storage::TensorInfo*> chunks, size_t dim, uint32_t count) {
  if (chunks.size() == 1) return source_of(*chunks[0], count);
  const size_t rank = chunks[0]->shape.size();
  for (; dim < rank; ++dim) {
    std::map<int64_t, std::vector<const storage::TensorInfo*>> slabs;
    for (const auto* chunk : chunks) slabs[chunk->chunk_offsets[dim]].push_back(chunk);
    if (slabs.size() == 1) continue;
    std::vector<ExprPtr> parts;
    for (auto& [offset, slab] : slabs) {
      for (const auto* chunk : slab)
        if (chunk->shape[dim] != slab[0]->shape[dim])
          throw Error("the chunks of " + quote(chunk->name()) + " do not form a grid (at offset " +
                      std::to_string(offset) + " of dimension " + std::to_string(dim) + " they are " +
                      std::to_string(slab[0]->shape[dim]) + " and " + std::to_string(chunk->shape[dim]) +
                      " long); vramd joins grids only");
      parts.push_back(join_chunks(std::move(slab), dim + 1, count));
    }
    return cat(parts, static_cast<int64_t>(dim));
  }
  throw Error("the chunks of " + quote(chunks[0]->name()) + " lie at one place");  // DiskMap refuses overlaps
}

// Raises "<what>: 2 files hold a slice of 'x' (a.pth, b.pth); ...", the script's line first.
int sharded_error(lua_State* L, const storage::DiskMap& map, const std::string& what, std::string_view name) {
  std::string files;
  const auto shards = map.shards(name);
  for (const auto& shard : shards) files += (files.empty() ? "" : ", ") + map.files()[shard.file].path;
  return luaL_error(L, "%s: %d files hold a slice of %s (%s); src:shards(name) gives each, for cat to join",
                    what.c_str(), static_cast<int>(shards.size()), quote(name).c_str(), files.c_str());
}

}  // namespace

ExprPtr whole_source(const storage::DiskMap& map, const storage::TensorInfo& info) {
  if (!info.chunk) return source_of(info);
  const auto chunks = map.shards(info.name());
  std::vector<const storage::TensorInfo*> all;
  for (const auto& chunk : chunks) all.push_back(&chunk);
  return join_chunks(std::move(all), 0, static_cast<uint32_t>(chunks.size()));
}

namespace {

// string.find and string.gsub, for the rules rename() leaves to Lua (see rename_in_lua).
constexpr const char* kStringFunctions = "return string.find, string.gsub";

// Runs `body`; a C++ error becomes a Lua error at the caller's line.
template <typename Body>
int guarded(lua_State* L, Body&& body) {
  std::string message;
  try {
    return body();
  } catch (const std::exception& e) {
    message = e.what();
  }
  luaL_where(L, 1);
  lua_pushstring(L, message.c_str());
  lua_concat(L, 2);
  return lua_error(L);
}

// `metatable`: where the tensor metatable is on the stack, when the caller has it there.
void push_tensor(lua_State* L, ExprPtr expr, int metatable = 0) {
  void* memory = lua_newuserdata(L, sizeof(ExprPtr));
  new (memory) ExprPtr(std::move(expr));
  if (metatable)
    lua_pushvalue(L, metatable);
  else
    luaL_getmetatable(L, kTensorType);
  lua_setmetatable(L, -2);
}

const ExprPtr& check_tensor(lua_State* L, int index) {
  return *static_cast<ExprPtr*>(luaL_checkudata(L, index, kTensorType));
}

int64_t check_int(lua_State* L, int index) {
  lua_Number value = luaL_checknumber(L, index);
  auto integer = static_cast<int64_t>(value);
  if (static_cast<lua_Number>(integer) != value) luaL_argerror(L, index, "expected a whole number");
  return integer;
}

// A list of integers given as a table {a, b, c} or as separate arguments from `index` on.
std::vector<int64_t> check_ints(lua_State* L, int index) {
  std::vector<int64_t> values;
  if (lua_istable(L, index)) {
    for (int i = 1, n = static_cast<int>(lua_objlen(L, index)); i <= n; ++i) {
      lua_rawgeti(L, index, i);
      values.push_back(check_int(L, -1));
      lua_pop(L, 1);
    }
    return values;
  }
  for (int i = index, top = lua_gettop(L); i <= top; ++i) values.push_back(check_int(L, i));
  return values;
}

std::vector<ExprPtr> check_tensor_list(lua_State* L, int index) {
  luaL_checktype(L, index, LUA_TTABLE);
  std::vector<ExprPtr> tensors;
  for (int i = 1, n = static_cast<int>(lua_objlen(L, index)); i <= n; ++i) {
    lua_rawgeti(L, index, i);
    tensors.push_back(check_tensor(L, -1));
    lua_pop(L, 1);
  }
  return tensors;
}

int push_all(lua_State* L, const std::vector<ExprPtr>& parts) {
  luaL_checkstack(L, static_cast<int>(parts.size()), "too many parts");
  for (const auto& part : parts) push_tensor(L, part);
  return static_cast<int>(parts.size());
}

// Tensor methods: each returns new lazy tensors.
int tensor_t(lua_State* L) {
  return guarded(L, [&] {
    const auto& input = check_tensor(L, 1);
    if (input->shape.size() != 2)
      throw Error("t() of " + input->describe() + ": needs 2 dimensions, has " + std::to_string(input->shape.size()));
    push_tensor(L, transpose(input, 0, 1));
    return 1;
  });
}
int tensor_transpose(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, transpose(check_tensor(L, 1), check_int(L, 2), check_int(L, 3))); return 1; });
}
int tensor_permute(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, permute(check_tensor(L, 1), check_ints(L, 2))); return 1; });
}
int tensor_reshape(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, reshape(check_tensor(L, 1), check_ints(L, 2))); return 1; });
}
int tensor_narrow(lua_State* L) {
  return guarded(L, [&] {
    push_tensor(L, narrow(check_tensor(L, 1), check_int(L, 2), check_int(L, 3), check_int(L, 4)));
    return 1;
  });
}
int tensor_chunk(lua_State* L) {
  return guarded(L, [&] {
    return push_all(L, chunk(check_tensor(L, 1), check_int(L, 2), lua_isnoneornil(L, 3) ? 0 : check_int(L, 3)));
  });
}
int tensor_split(lua_State* L) {
  return guarded(L, [&] {
    luaL_checktype(L, 2, LUA_TTABLE);
    auto sizes = check_ints(L, 2);
    return push_all(L, split(check_tensor(L, 1), sizes, lua_isnoneornil(L, 3) ? 0 : check_int(L, 3)));
  });
}
int tensor_cast(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, cast(check_tensor(L, 1), parse_dtype_name(luaL_checkstring(L, 2)))); return 1; });
}
int tensor_scale(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, scale(check_tensor(L, 1), luaL_checknumber(L, 2))); return 1; });
}
int tensor_shift(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, shift(check_tensor(L, 1), luaL_checknumber(L, 2))); return 1; });
}
int tensor_tostring(lua_State* L) {
  const auto& expr = check_tensor(L, 1);
  std::string text = expr->describe() + " " + dtype_torch_name(expr->dtype) + " " + format_shape(expr->shape);
  lua_pushlstring(L, text.data(), text.size());
  return 1;
}
int tensor_gc(lua_State* L) {
  static_cast<ExprPtr*>(luaL_checkudata(L, 1, kTensorType))->~ExprPtr();
  return 0;
}

int tensor_index(lua_State* L) {
  // [tensor, key]
  const auto& expr = check_tensor(L, 1);
  const std::string key = luaL_checkstring(L, 2);
  if (key == "shape") {
    lua_createtable(L, static_cast<int>(expr->shape.size()), 0);
    for (size_t i = 0; i < expr->shape.size(); ++i) {
      lua_pushnumber(L, static_cast<lua_Number>(expr->shape[i]));
      lua_rawseti(L, -2, static_cast<int>(i + 1));
    }
    return 1;
  }
  if (key == "dtype") {
    lua_pushstring(L, dtype_torch_name(expr->dtype).c_str());
    return 1;
  }
  if (key == "ndim") {
    lua_pushnumber(L, static_cast<lua_Number>(expr->shape.size()));
    return 1;
  }
  if (key == "key") {
    if (expr->op == Expr::Op::Source) lua_pushstring(L, expr->source.c_str()); else lua_pushnil(L);
    return 1;
  }
  luaL_getmetatable(L, kTensorType);  // [tensor, key, metatable]
  lua_getfield(L, -1, "methods");     // [tensor, key, metatable, methods]
  lua_getfield(L, -1, key.c_str());   // [tensor, key, metatable, methods, method]
  if (lua_isnil(L, -1)) return luaL_error(L, "tensors have no field or method '%s'", key.c_str());
  return 1;
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

std::string_view string_at(lua_State* L, int index) {
  size_t size = 0;
  const char* data = lua_tolstring(L, index, &size);
  return {data, size};
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

int global_cat(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, cat(check_tensor_list(L, 1), lua_isnoneornil(L, 2) ? 0 : check_int(L, 2))); return 1; });
}
int global_zeros(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, zeros(check_ints(L, 1), parse_dtype_name(luaL_checkstring(L, 2)))); return 1; });
}
int global_stack(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, stack(check_tensor_list(L, 1), lua_isnoneornil(L, 2) ? 0 : check_int(L, 2))); return 1; });
}

void register_type(lua_State* L, const char* name, lua_CFunction index, std::initializer_list<luaL_Reg> methods,
                   std::initializer_list<luaL_Reg> metamethods) {
  luaL_newmetatable(L, name);  // [metatable]
  lua_newtable(L);             // [metatable, methods]
  for (const auto& method : methods) {
    lua_pushcfunction(L, method.func);
    lua_setfield(L, -2, method.name);
  }
  lua_setfield(L, -2, "methods");
  lua_pushcfunction(L, index);
  lua_setfield(L, -2, "__index");
  for (const auto& method : metamethods) {
    lua_pushcfunction(L, method.func);
    lua_setfield(L, -2, method.name);
  }
  lua_pushboolean(L, 0);
  lua_setfield(L, -2, "__metatable");
  lua_pop(L, 1);
}

// Pops the top value into the globals; rawset, since the sandbox refuses ordinary assignment.
void set_global(lua_State* L, const char* name) {
  lua_pushvalue(L, LUA_GLOBALSINDEX);  // [value, globals]
  lua_pushstring(L, name);             // [value, globals, name]
  lua_pushvalue(L, -3);                // [value, globals, name, value]
  lua_rawset(L, -3);                   // [value, globals]
  lua_pop(L, 2);
}

// The tensor at `index`, or null when the value there is something else; `metatable`: the
// absolute stack index of the tensor metatable.
const ExprPtr* to_tensor(lua_State* L, int index, int metatable) {
  void* memory = lua_touserdata(L, index);
  if (!memory || !lua_getmetatable(L, index)) return nullptr;
  const bool is_tensor = lua_rawequal(L, -1, metatable);
  lua_pop(L, 1);
  return is_tensor ? static_cast<const ExprPtr*>(memory) : nullptr;
}

void install_api(lua_State* L, Source* source) {
  register_type(L, kTensorType, tensor_index,
                {{"t", tensor_t}, {"transpose", tensor_transpose}, {"permute", tensor_permute},
                 {"reshape", tensor_reshape}, {"view", tensor_reshape}, {"narrow", tensor_narrow},
                 {"chunk", tensor_chunk}, {"split", tensor_split}, {"cast", tensor_cast}, {"to", tensor_cast},
                 {"scale", tensor_scale}, {"shift", tensor_shift}},
                {{"__tostring", tensor_tostring}, {"__gc", tensor_gc}});
  register_type(L, kSourceType, source_index,
                {{"get", source_get}, {"has", source_has}, {"keys", source_keys}, {"items", source_items},
                 {"shards", source_shards}, {"renamed", source_renamed}},
                {{"__len", source_len}});
  auto* memory = static_cast<Source*>(lua_newuserdata(L, sizeof(Source)));
  *memory = *source;
  luaL_getmetatable(L, kSourceType);
  lua_setmetatable(L, -2);
  set_global(L, "src");
  lua_pushcfunction(L, global_cat);
  set_global(L, "cat");
  lua_pushcfunction(L, global_stack);
  set_global(L, "stack");
  lua_pushcfunction(L, global_zeros);
  set_global(L, "zeros");
}

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

std::string read_script(const std::string& path) { return read_regular_file(path, kMaxConfigBytes); }

}  // namespace

ConversionPlan run_converter(const std::string& script_path, const storage::DiskMap& map, const std::string& arch_json,
                             const SandboxLimits& limits) {
  const std::string code = read_script(script_path);
  Source source{&map};
  LuaSandbox sandbox(limits);
  lua_State* L = sandbox.state();

  ConversionPlan plan;
  try {
    install_api(L, &source);
    push_json(L, nlohmann::json::parse(arch_json));
    set_global(L, "arch");
    sandbox.run(kStringFunctions, "vramd rename", 0, 2);
    lua_setfield(L, LUA_REGISTRYINDEX, "vramd.gsub");
    lua_setfield(L, LUA_REGISTRYINDEX, "vramd.find");
    lua_pushcfunction(L, global_rename);
    set_global(L, "rename");

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
  luaL_getmetatable(L, kTensorType);  // [result, metatable]
  const int metatable = lua_gettop(L);
  lua_pushnil(L);  // [result, metatable, nil]
  while (lua_next(L, -3) != 0) {  // [result, metatable, key, value]
    if (lua_type(L, -2) != LUA_TSTRING)
      fail(script_path, std::string("returned a table with a ") + luaL_typename(L, -2) +
                            " key; target names are strings");
    const std::string_view name = string_at(L, -2);
    if (!valid_utf8(name))
      fail(script_path, "target " + quote(name) + " is not valid UTF-8, as safetensors and vramd's replies need");
    const ExprPtr* value = to_tensor(L, -1, metatable);
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
