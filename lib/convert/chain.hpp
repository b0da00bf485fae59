// One converter run over another's results, as the text of one converter: the first runs as a
// function of the checkpoint's `src`, and the second sees the table it returns as its `src`
// (index it by name, iterate it with pairs). Used where a second converter was written for the
// first one's names: a client's derive over its base's converter (server/derive.cpp), and
// transformers' rules over gguf.lua's names (load/conversion.hpp).
#pragma once

#include <string>

namespace vramd::convert {

// The two converters' texts as one. A name the first does not give is an error naming it and
// `first_name` ("the base's converter (PATH)"), as src[name] of a checkpoint is: a plain
// table's nil would drop the target that reads it without a word. The first text's lines keep
// their numbers.
std::string chained(const std::string& first_name, const std::string& first, const std::string& second);

// `text` as a Lua string literal: every byte but printable ASCII, the quote and the backslash as
// a three-digit escape (so that a digit after one cannot extend it).
std::string lua_literal(const std::string& text);

}  // namespace vramd::convert
