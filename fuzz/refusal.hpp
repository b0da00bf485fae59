// What a fuzz target's input file may be refused with: one message, valid UTF-8, whose every
// line names the file (the daemon logs each, `vramctl check` prints each).
#pragma once

#include <algorithm>
#include <string_view>

#include "util/utf8.hpp"

inline bool names_the_file_on_every_line(std::string_view what, std::string_view file) {
  if (!vramd::valid_utf8(what)) return false;
  for (size_t begin = 0; begin <= what.size();) {
    const size_t end = std::min(what.find('\n', begin), what.size());
    if (what.substr(begin, end - begin).find(file) == std::string_view::npos) return false;
    begin = end + 1;
  }
  return true;
}
