// UTF-8 validity, the one rule for text that came from outside (paths, request targets, file
// names, checkpoint keys, script errors) before it reaches a message or a JSON answer.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace vramd {

// The length of the well-formed UTF-8 sequence that starts at text[at] (1 to 4), or 0 when
// the bytes there are not one: a stray continuation byte, an overlong form, a surrogate, a
// code point past U+10FFFF, or a sequence cut short.
size_t utf8_sequence_length(std::string_view text, size_t at);

bool valid_utf8(std::string_view text);

// `text` with each byte that is not part of a well-formed sequence written as \xNN, and
// control characters likewise: always valid UTF-8, and different inputs stay different.
std::string escape_invalid_utf8(std::string_view text);

// For a line on its way to a terminal or a log that may still hold bytes from outside: as
// escape_invalid_utf8, but keeping tabs and backslashes, so that text escaped before is not
// escaped twice. A backstop, not a quoting: different inputs may look the same.
std::string printable(std::string_view text);

}  // namespace vramd
