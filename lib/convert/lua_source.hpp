// The checkpoint in the converter's Lua (`src`: get, has, keys, items, shards, renamed, src[name],
// #src) and rename(), whose patterns are matched in C++ (convert/lua_pattern.hpp) where they can
// be, and by Lua's string functions where not. Included by convert/converter.cpp alone.
#pragma once

#include <lua.hpp>

#include "storage/disk_map.hpp"

namespace vramd::convert::lua {

// string.find and string.gsub, for the rules rename() leaves to Lua (see rename_in_lua).
inline constexpr const char* kStringFunctions = "return string.find, string.gsub";
// rename() leaves the rules it cannot match itself to them: run this chunk and keep its two
// results in the registry as "vramd.find" and "vramd.gsub" before a script runs.

// Sets the global `src`: the checkpoint `map`, which must outlive the script's run.
void install_source(lua_State* L, const storage::DiskMap& map);
// Sets the global rename().
void install_rename(lua_State* L);

}  // namespace vramd::convert::lua
