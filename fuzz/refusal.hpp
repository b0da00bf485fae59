// What a fuzz target's input file may be refused with: one message, valid UTF-8 with no control
// byte but the line ends, whose every line names the file (the daemon logs each, `vramctl check`
// prints each).
#pragma once

#include <algorithm>
#include <string>
#include <string_view>

#include "util/format.hpp"
#include "util/utf8.hpp"

inline bool names_the_file_on_every_line(std::string_view what, std::string_view file) {
  const auto lines = vramd::split_lines(what);
  const auto control = [](char c) { return (static_cast<unsigned char>(c) < 0x20 && c != '\n') || c == 0x7f; };
  return vramd::valid_utf8(what) && std::none_of(what.begin(), what.end(), control) &&
         std::all_of(lines.begin(), lines.end(), [&](const std::string& line) { return line.find(file) != std::string::npos; });
}
