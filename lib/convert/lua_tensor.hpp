// The converter's lazy tensors in Lua: each method (t, transpose, permute, reshape, narrow, chunk,
// split, cast, scale, shift) returns new expressions (convert/expr.hpp), and so do the globals
// cat, stack and zeros. Included by convert/converter.cpp alone.
#pragma once

#include <lua.hpp>

namespace vramd::convert::lua {

// Registers the tensor type and sets the globals cat, stack and zeros.
void install_tensors(lua_State* L);

}  // namespace vramd::convert::lua
