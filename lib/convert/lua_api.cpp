#include "convert/lua_api.hpp"

#include <new>

namespace vramd::convert::lua {

void push_tensor(lua_State* L, ExprPtr expr, int metatable) {
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

std::string_view string_at(lua_State* L, int index) {
  size_t size = 0;
  const char* data = lua_tolstring(L, index, &size);
  return {data, size};
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

void set_global(lua_State* L, const char* name) {
  lua_pushvalue(L, LUA_GLOBALSINDEX);  // [value, globals]
  lua_pushstring(L, name);             // [value, globals, name]
  lua_pushvalue(L, -3);                // [value, globals, name, value]
  lua_rawset(L, -3);                   // [value, globals]
  lua_pop(L, 2);
}

const ExprPtr* to_tensor(lua_State* L, int index, int metatable) {
  void* memory = lua_touserdata(L, index);
  if (!memory || !lua_getmetatable(L, index)) return nullptr;
  const bool is_tensor = lua_rawequal(L, -1, metatable);
  lua_pop(L, 1);
  return is_tensor ? static_cast<const ExprPtr*>(memory) : nullptr;
}

}  // namespace vramd::convert::lua
