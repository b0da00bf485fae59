// Small text helpers shared by error messages and CLI output.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vramd {

// "1.50 GiB", "512 B": binary units, two decimals above bytes.
std::string format_bytes(uint64_t bytes);

// format_bytes(bytes), with the exact count beside it where `other`, the size it is compared with
// in the same message, would print the same though it differs: "1.00 GiB (1074790400 bytes)".
std::string format_bytes_beside(uint64_t bytes, uint64_t other);

// "0.005 s", "12.346 s": seconds to the millisecond, as logs and messages print durations.
std::string format_seconds(double seconds);

// "1 tensor", "2 tensors": a count and its noun, plural unless the count is 1 (nouns in -s alone).
std::string counted(uint64_t count, std::string_view noun);

// "[2, 3, 4]"
std::string format_shape(std::span<const int64_t> shape);

// `text` followed by spaces up to `width` characters (unchanged when it is already as wide), for columns.
std::string pad(std::string text, size_t width);

// Rows as columns as wide as their widest cell, two spaces apart, each line `indent` spaces in
// and ended by a newline (the last column unpadded).
std::string format_table(const std::vector<std::vector<std::string>>& rows, size_t indent = 0);

// The lines of a multi-line message, without their newlines.
std::vector<std::string> split_lines(std::string_view text);

// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(std::string_view a, std::string_view b);

// The nearest of `candidates` to `word` when it is close enough to be a likely typo (an edit
// distance under a third of its length, at least 2), for "did you mean" suggestions.
std::optional<std::string> did_you_mean(std::string_view word, const std::vector<std::string_view>& candidates);

// Quotes a key or path for a message: 'h.0.w', escaped as escape_invalid_utf8 does (always
// valid UTF-8).
std::string quote(std::string_view text);

}  // namespace vramd
