#include "convert/chain.hpp"

#include <cstdio>

namespace vramd::convert {

std::string lua_literal(const std::string& text) {
  std::string out = "\"";
  for (const unsigned char c : text) {
    if (c >= 32 && c < 127 && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char escape[5];
      std::snprintf(escape, sizeof escape, "\\%03u", c);
      out += escape;
    }
  }
  return out + "\"";
}

std::string chained(const std::string& first_name, const std::string& first, const std::string& second) {
  // The first's first line is the text's first: its errors keep their line numbers.
  return "local src = setmetatable((function(src) " + first + "\nend)(src), {__index = function(_, name)\n"
         "  error(" + lua_literal(first_name) + " .. \" gives no tensor named '\" .. tostring(name) .. \"'\", 2)\n"
         "end})\n-- Above: the converter run first. Below: the one written for its results.\n" + second;
}

}  // namespace vramd::convert
