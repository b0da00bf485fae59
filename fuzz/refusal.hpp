// What a fuzz target's input file may be refused with: one message, valid UTF-8, whose every
// line names the file (the daemon logs each, `vramctl check` prints each).
#pragma once

#include <algorithm>
#include <string>
#include <string_view>

#include "util/format.hpp"
#include "util/utf8.hpp"

inline bool names_the_file_on_every_line(std::string_view what, std::string_view file) {
  const auto lines = vramd::split_lines(what);
  return vramd::valid_utf8(what) &&
         std::all_of(lines.begin(), lines.end(), [&](const std::string& line) { return line.find(file) != std::string::npos; });
}
