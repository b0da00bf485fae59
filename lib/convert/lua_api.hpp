// What the converter's Lua API is made of, shared by its parts (convert/lua_tensor.cpp: the lazy
// tensors; convert/lua_source.cpp: `src` and rename; convert/converter.cpp: running a script):
// the userdata types, the one bridge from C++ errors to Lua errors, and the checks of arguments.
// Included by those files alone: it pulls in LuaJIT.
#pragma once

#include <lua.hpp>

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "convert/expr.hpp"

namespace vramd::convert::lua {

inline constexpr const char* kTensorType = "vramd.Tensor";
inline constexpr const char* kSourceType = "vramd.Source";

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
void push_tensor(lua_State* L, ExprPtr expr, int metatable = 0);

const ExprPtr& check_tensor(lua_State* L, int index);

int64_t check_int(lua_State* L, int index);

// A list of integers given as a table {a, b, c} or as separate arguments from `index` on.
std::vector<int64_t> check_ints(lua_State* L, int index);

std::vector<ExprPtr> check_tensor_list(lua_State* L, int index);

int push_all(lua_State* L, const std::vector<ExprPtr>& parts);

std::string_view string_at(lua_State* L, int index);

void register_type(lua_State* L, const char* name, lua_CFunction index, std::initializer_list<luaL_Reg> methods,
                   std::initializer_list<luaL_Reg> metamethods);

// Pops the top value into the globals; rawset, since the sandbox refuses ordinary assignment.
void set_global(lua_State* L, const char* name);

// The tensor at `index`, or null when the value there is something else; `metatable`: the
// absolute stack index of the tensor metatable.
const ExprPtr* to_tensor(lua_State* L, int index, int metatable);

}  // namespace vramd::convert::lua
