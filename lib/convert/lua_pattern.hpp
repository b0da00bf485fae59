// string.gsub(subject, pattern, replacement) for Lua 5.1 patterns and a string replacement,
// in C++: the converter's rename() runs it over every key, and a call from Lua into
// string.find and string.gsub per rule costs more than the match itself.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace vramd::convert {

struct Substitution {
  std::string text;  // empty when count is 0
  int count = 0;     // replacements made
};

// Returns nullopt for what it leaves to Lua's own string.gsub: position captures, back-references,
// %b, %f, deep backtracking and every malformed pattern or replacement. The caller then runs
// string.gsub, which gives the same result or the error message users expect from Lua.
std::optional<Substitution> lua_gsub(std::string_view subject, std::string_view pattern,
                                     std::string_view replacement);

}  // namespace vramd::convert
