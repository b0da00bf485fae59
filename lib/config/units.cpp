#include "config/units.hpp"

#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::config {
namespace {

struct Unit {
  std::string_view name;
  double factor;
};

constexpr std::array kSizeUnits = {
    Unit{"", 1},           Unit{"B", 1},
    Unit{"K", 1024.0},     Unit{"KiB", 1024.0},           Unit{"KB", 1e3},
    Unit{"M", 1048576.0},  Unit{"MiB", 1048576.0},        Unit{"MB", 1e6},
    Unit{"G", 1073741824.0}, Unit{"GiB", 1073741824.0},   Unit{"GB", 1e9},
    Unit{"T", 1099511627776.0}, Unit{"TiB", 1099511627776.0}, Unit{"TB", 1e12},
};

constexpr std::array kTimeUnits = {
    Unit{"ms", 1}, Unit{"s", 1e3}, Unit{"m", 60e3}, Unit{"h", 3600e3}, Unit{"d", 86400e3},
};

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  return text;
}

// A non-negative decimal number at the front of `text`, which it consumes.
std::optional<double> take_number(std::string_view& text) {
  size_t length = 0;
  while (length < text.size() && (std::isdigit(static_cast<unsigned char>(text[length])) || text[length] == '.'))
    ++length;
  double value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + length, value);
  if (length == 0 || error != std::errc() || end != text.data() + length) return std::nullopt;
  text.remove_prefix(length);
  return value;
}

}  // namespace

uint64_t parse_size(std::string_view original) {
  const std::string expected = " is not a size; expected a number and a unit such as \"512MiB\", \"2GiB\" or \"1.5GB\"";
  std::string_view text = trim(original);
  auto number = take_number(text);
  if (!number) throw Error(quote(original) + expected);
  text = trim(text);
  for (const auto& unit : kSizeUnits) {
    if (unit.name != text) continue;
    const double bytes = std::round(*number * unit.factor);
    if (bytes >= 18446744073709551615.0) throw Error(quote(original) + " is too large a size");
    return static_cast<uint64_t>(bytes);
  }
  throw Error(quote(original) + expected);
}

std::optional<std::chrono::milliseconds> parse_duration(std::string_view original) {
  std::string_view text = trim(original);
  if (text == "-1") return std::nullopt;
  const std::string expected =
      " is not a duration; expected e.g. \"30s\", \"10m\", \"1h30m\", \"250ms\", \"0\", or \"-1\" for forever";
  if (text == "0") return std::chrono::milliseconds(0);
  if (text.empty()) throw Error(quote(original) + expected);
  double total = 0;
  while (!text.empty()) {
    auto number = take_number(text);
    if (!number) throw Error(quote(original) + expected);
    size_t length = 0;
    while (length < text.size() && std::isalpha(static_cast<unsigned char>(text[length]))) ++length;
    const auto name = text.substr(0, length);
    text.remove_prefix(length);
    const Unit* unit = nullptr;
    for (const auto& candidate : kTimeUnits)
      if (candidate.name == name) unit = &candidate;
    if (!unit) throw Error(quote(original) + expected);
    total += *number * unit->factor;
  }
  if (total > static_cast<double>(std::numeric_limits<int64_t>::max() / 2)) throw Error(quote(original) + " is too long");
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(total)));
}

std::string format_duration(std::optional<std::chrono::milliseconds> duration) {
  if (!duration) return "forever";
  const auto ms = duration->count();
  if (ms % 3600000 == 0 && ms) return std::to_string(ms / 3600000) + "h";
  if (ms % 60000 == 0 && ms) return std::to_string(ms / 60000) + "m";
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + "s";
  return std::to_string(ms) + "ms";
}

}  // namespace vramd::config
