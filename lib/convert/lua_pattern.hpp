// string.gsub(subject, pattern, replacement) for Lua 5.1 patterns and a string replacement,
// in C++: the converter's rename() runs it over every key, and a call from Lua into
// string.find and string.gsub per rule costs more than the match itself.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace vramd::convert {

struct Substitution {
  std::string text;  // empty when count is 0
  int count = 0;     // replacements made
};

// A pattern that backtracks past `max_steps` (such as ".-.-.-.-x" over a long name). Lua's own
// matcher would go on for as long as it takes, and inside it no time limit can fire.
struct PatternTooComplex : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr uint64_t kMaxPatternSteps = 10'000'000;  // some tens of milliseconds

// Returns nullopt for what it leaves to Lua's own string.gsub: position captures, back-references,
// %b, %f, deep recursion, a match that leaves a capture open (string.find, which rename() calls
// first, fails on it) and every malformed pattern or replacement. The caller then runs
// string.gsub, which gives the same result or the error message users expect from Lua.
std::optional<Substitution> lua_gsub(std::string_view subject, std::string_view pattern,
                                     std::string_view replacement, uint64_t max_steps = kMaxPatternSteps);

}  // namespace vramd::convert
