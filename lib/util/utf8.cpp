#include "util/utf8.hpp"

#include <cstdint>
#include <cstdio>

namespace vramd {

size_t utf8_sequence_length(std::string_view text, size_t at) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[at + i]); };
  const size_t left = text.size() - at;
  const uint8_t lead = byte(0);
  if (lead < 0x80) return 1;
  size_t length;
  uint8_t low = 0x80, high = 0xbf;  // the range of the second byte (Unicode's table 3-7)
  if (lead >= 0xc2 && lead <= 0xdf) length = 2;
  else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    if (lead == 0xe0) low = 0xa0;        // overlong
    else if (lead == 0xed) high = 0x9f;  // surrogates
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    if (lead == 0xf0) low = 0x90;        // overlong
    else if (lead == 0xf4) high = 0x8f;  // past U+10FFFF
  } else {
    return 0;
  }
  if (left < length || byte(1) < low || byte(1) > high) return 0;
  for (size_t i = 2; i < length; ++i)
    if ((byte(i) & 0xc0) != 0x80) return 0;
  return length;
}

bool valid_utf8(std::string_view text) {
  for (size_t at = 0; at < text.size();) {
    const size_t length = utf8_sequence_length(text, at);
    if (length == 0) return false;
    at += length;
  }
  return true;
}

namespace {

// Bytes outside a well-formed sequence, control bytes but a tab where `tab` keeps it, and DEL
// as \xNN; a backslash as \\ where `backslash` says.
std::string escaped(std::string_view text, bool backslash, bool tab) {
  std::string out;
  out.reserve(text.size());
  for (size_t at = 0; at < text.size();) {
    const size_t length = utf8_sequence_length(text, at);
    const auto c = static_cast<uint8_t>(text[at]);
    if (length == 0 || (c < 0x20 && !(tab && c == '\t')) || c == 0x7f || (backslash && c == '\\')) {
      char code[8];
      if (c == '\\') std::snprintf(code, sizeof code, "\\\\");
      else std::snprintf(code, sizeof code, "\\x%02x", c);
      out += code;
      ++at;
    } else {
      out.append(text.substr(at, length));
      at += length;
    }
  }
  return out;
}

}  // namespace

std::string escape_invalid_utf8(std::string_view text) { return escaped(text, true, false); }

std::string printable(std::string_view text) { return escaped(text, false, true); }

}  // namespace vramd
