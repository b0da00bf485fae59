// libFuzzer target: lua_gsub (the C++ matcher behind the converters' rename()) against LuaJIT's
// own string.find and string.gsub. The input is a name, a pattern and a replacement separated by
// NUL bytes. Wherever lua_gsub answers, Lua must give the same answer without an error: the
// rule matches exactly when string.find finds it, and the new name is string.gsub's. Where it
// declines, Lua decides; a pattern too complex to finish is refused by both in their way.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <lua.hpp>

#include "convert/lua_pattern.hpp"

namespace {

lua_State* lua() {
  static lua_State* L = [] {
    lua_State* state = luaL_newstate();
    luaL_openlibs(state);
    return state;
  }();
  return L;
}

// string.find(name, pattern) and string.gsub(name, pattern, replacement) in LuaJIT; false
// when either raises an error.
bool lua_rename(std::string_view name, std::string_view pattern, std::string_view replacement, bool& found,
                std::string& renamed) {
  lua_State* L = lua();
  lua_settop(L, 0);
  lua_getglobal(L, "string");
  lua_getfield(L, 1, "find");
  lua_pushlstring(L, name.data(), name.size());
  lua_pushlstring(L, pattern.data(), pattern.size());
  if (lua_pcall(L, 2, 1, 0) != 0) return false;
  found = !lua_isnil(L, -1);
  lua_getfield(L, 1, "gsub");
  lua_pushlstring(L, name.data(), name.size());
  lua_pushlstring(L, pattern.data(), pattern.size());
  lua_pushlstring(L, replacement.data(), replacement.size());
  if (lua_pcall(L, 3, 1, 0) != 0) return false;
  size_t size = 0;
  const char* text = lua_tolstring(L, -1, &size);
  renamed.assign(text, size);
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Short inputs: a long pattern can backtrack for longer than a fuzz run, in Lua as well.
  if (size > 64) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t first = input.find('\0');
  if (first == std::string_view::npos) return 0;
  const size_t second = input.find('\0', first + 1);
  if (second == std::string_view::npos) return 0;
  const std::string_view name = input.substr(0, first), pattern = input.substr(first + 1, second - first - 1),
                         replacement = input.substr(second + 1);
  std::optional<vramd::convert::Substitution> ours;
  try {
    ours = vramd::convert::lua_gsub(name, pattern, replacement, 100'000);
  } catch (const vramd::convert::PatternTooComplex&) {
    return 0;
  }
  if (!ours) return 0;
  bool found = false;
  std::string renamed;
  if (!lua_rename(name, pattern, replacement, found, renamed)) std::abort();  // Lua refused what we took
  if (found != (ours->count > 0)) std::abort();
  if (found && renamed != ours->text) std::abort();
  return 0;
}
