#include "convert/lua_tensor.hpp"

#include "convert/lua_api.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::convert::lua {
namespace {

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

int global_cat(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, cat(check_tensor_list(L, 1), lua_isnoneornil(L, 2) ? 0 : check_int(L, 2))); return 1; });
}

int global_zeros(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, zeros(check_ints(L, 1), parse_dtype_name(luaL_checkstring(L, 2)))); return 1; });
}

int global_stack(lua_State* L) {
  return guarded(L, [&] { push_tensor(L, stack(check_tensor_list(L, 1), lua_isnoneornil(L, 2) ? 0 : check_int(L, 2))); return 1; });
}

}  // namespace

void install_tensors(lua_State* L) {
  register_type(L, kTensorType, tensor_index,
                {{"t", tensor_t}, {"transpose", tensor_transpose}, {"permute", tensor_permute},
                 {"reshape", tensor_reshape}, {"view", tensor_reshape}, {"narrow", tensor_narrow},
                 {"chunk", tensor_chunk}, {"split", tensor_split}, {"cast", tensor_cast}, {"to", tensor_cast},
                 {"scale", tensor_scale}, {"shift", tensor_shift}},
                {{"__tostring", tensor_tostring}, {"__gc", tensor_gc}});
  lua_pushcfunction(L, global_cat);
  set_global(L, "cat");
  lua_pushcfunction(L, global_stack);
  set_global(L, "stack");
  lua_pushcfunction(L, global_zeros);
  set_global(L, "zeros");
}

}  // namespace vramd::convert::lua
