#include "config/toml_schema.hpp"

#include <algorithm>
#include <tuple>
#include <sstream>

#include "config/units.hpp"
#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::config {
namespace {

std::string position(const std::string& file, const toml::source_region& where) {
  if (!where.begin) return file;
  return file + ":" + std::to_string(where.begin.line) + ":" + std::to_string(where.begin.column);
}

std::string type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a number";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    default: return "a date or time";
  }
}

// One line: a string is quoted by us, not by toml++, which prints one holding a newline as a
// multi-line string.
std::string value_text(const toml::node& node) {
  if (node.is_table()) return "{...}";
  if (node.is_array()) return "[...]";
  if (const auto* text = node.as_string()) return quote(text->get());
  std::ostringstream out;
  node.visit([&](const auto& value) { out << value; });
  return out.str();
}

}  // namespace

void Problems::add(const toml::source_region& where, const std::string& message) {
  lines_.push_back({where.begin.line, where.begin.column, position(file_, where) + ": " + message});
}

void Problems::add_whole_file(const std::string& message) { lines_.push_back({0, 0, message}); }

void Problems::throw_if_any() const {
  if (lines_.empty()) return;
  auto sorted = lines_;
  std::stable_sort(sorted.begin(), sorted.end(), [](const Line& a, const Line& b) {
    return std::tie(a.line, a.column) < std::tie(b.line, b.column);
  });
  std::string text;
  for (const auto& line : sorted) text += (text.empty() ? "" : "\n") + line.text;
  throw Error(text);
}

TableReader::TableReader(const toml::table& table, std::string name, Problems& problems)
    : table_(table), name_(std::move(name)), problems_(problems) {}

// Escaped: some keys are the user's own ([budgets], a family's switches), and TOML allows any
// character in a quoted key.
std::string TableReader::qualified(std::string_view key) const {
  return name_.empty() ? escape_invalid_utf8(key) : name_ + "." + escape_invalid_utf8(key);
}

const toml::node* TableReader::node(std::string_view key) {
  known_.emplace(key);
  return table_.get(key);
}

void TableReader::bad_value(std::string_view key, const std::string& message) {
  const toml::node* value = table_.get(key);
  if (!value) return problem(message);
  problems_.add(value->source(), qualified(key) + " = " + value_text(*value) + ": " + message);
}

std::optional<std::string> TableReader::string(std::string_view key) {
  const toml::node* value = node(key);
  if (!value) return std::nullopt;
  if (auto text = value->value<std::string>(); text && value->is_string()) return *text;
  bad_value(key, "expected a string, found " + type_name(*value));
  return std::nullopt;
}

std::optional<bool> TableReader::boolean(std::string_view key) {
  const toml::node* value = node(key);
  if (!value) return std::nullopt;
  if (value->is_boolean()) return *value->value<bool>();
  bad_value(key, "expected true or false, found " + type_name(*value));
  return std::nullopt;
}

std::optional<std::vector<std::string>> TableReader::strings(std::string_view key) {
  const toml::node* value = node(key);
  if (!value) return std::nullopt;
  if (value->is_string()) return std::vector<std::string>{*value->value<std::string>()};
  if (const auto* array = value->as_array()) {
    std::vector<std::string> out;
    for (const auto& item : *array) {
      if (!item.is_string()) {
        bad_value(key, "expected strings, found " + type_name(item) + " in the array");
        return std::nullopt;
      }
      out.push_back(*item.value<std::string>());
    }
    return out;
  }
  bad_value(key, "expected a string or an array of strings, found " + type_name(*value));
  return std::nullopt;
}

std::optional<int64_t> TableReader::integer(std::string_view key, int64_t min, int64_t max) {
  const toml::node* value = node(key);
  if (!value) return std::nullopt;
  if (value->is_integer() && *value->value<int64_t>() >= min && *value->value<int64_t>() <= max) return *value->value<int64_t>();
  bad_value(key, "expected an integer from " + std::to_string(min) + " to " + std::to_string(max) +
                     (value->is_integer() ? "" : ", found " + type_name(*value)));
  return std::nullopt;
}

std::optional<std::vector<int64_t>> TableReader::integers(std::string_view key, int64_t min, int64_t max) {
  const toml::node* value = node(key);
  if (!value) return std::nullopt;
  const auto* array = value->as_array();
  std::vector<int64_t> out;
  for (size_t i = 0; array && i < array->size(); ++i) {
    const auto& item = *array->get(i);
    if (!item.is_integer() || *item.value<int64_t>() < min || *item.value<int64_t>() > max) break;
    out.push_back(*item.value<int64_t>());
  }
  if (array && out.size() == array->size()) return out;
  bad_value(key, "expected an array of integers from " + std::to_string(min) + " to " + std::to_string(max));
  return std::nullopt;
}

std::optional<uint64_t> TableReader::size(std::string_view key) {
  const toml::node* value = node(key);
  if (!value) return std::nullopt;
  if (value->is_integer() && *value->value<int64_t>() >= 0) return static_cast<uint64_t>(*value->value<int64_t>());
  if (!value->is_string()) {
    bad_value(key, "expected a size such as \"6GiB\" or a number of bytes, found " + type_name(*value));
    return std::nullopt;
  }
  try {
    return parse_size(*value->value<std::string>());
  } catch (const Error& e) {
    bad_value(key, e.what());
    return std::nullopt;
  }
}

std::optional<std::optional<std::chrono::milliseconds>> TableReader::duration(std::string_view key) {
  const toml::node* value = node(key);
  if (!value) return std::nullopt;
  if (!value->is_string() && !(value->is_integer() && (*value->value<int64_t>() == -1 || *value->value<int64_t>() == 0))) {
    bad_value(key, "expected a duration such as \"10m\", or \"-1\" for forever, found " + type_name(*value));
    return std::nullopt;
  }
  try {
    return parse_duration(value->is_string() ? *value->value<std::string>() : std::to_string(*value->value<int64_t>()));
  } catch (const Error& e) {
    bad_value(key, e.what());
    return std::nullopt;
  }
}

std::optional<TableReader> TableReader::table(std::string_view key) {
  const toml::node* value = node(key);
  if (!value) return std::nullopt;
  if (const auto* table = value->as_table()) return TableReader(*table, qualified(key), problems_);
  bad_value(key, "expected a table, found " + type_name(*value));
  return std::nullopt;
}

std::vector<TableReader> TableReader::tables(std::string_view key) {
  const toml::node* value = node(key);
  std::vector<TableReader> out;
  if (!value) return out;
  const auto* array = value->as_array();
  if (array && array->is_array_of_tables()) {
    for (size_t i = 0; i < array->size(); ++i)
      out.emplace_back(*array->get(i)->as_table(), qualified(key) + "[" + std::to_string(i + 1) + "]", problems_);
    return out;
  }
  bad_value(key, "expected tables ([[" + qualified(key) + "]] headers), found " + type_name(*value));
  return out;
}

std::optional<double> TableReader::number(std::string_view key, double min, double max) {
  const toml::node* value = node(key);
  if (!value) return std::nullopt;
  const std::optional<double> number = value->is_floating_point() ? value->value<double>()
                                       : value->is_integer()      ? std::optional<double>(*value->value<int64_t>())
                                                                  : std::nullopt;
  if (number && *number >= min && *number <= max) return number;  // NaN is in no range
  std::ostringstream range;
  range << "expected a number from " << min << " to " << max;
  bad_value(key, range.str() + (number ? "" : ", found " + type_name(*value)));
  return std::nullopt;
}

std::vector<std::string_view> TableReader::keys() const {
  std::vector<std::string_view> out;
  for (const auto& [key, value] : table_) out.push_back(key.str());
  return out;
}

void TableReader::finish() {
  std::vector<std::string_view> known(known_.begin(), known_.end());
  for (const auto& [key, value] : table_) {
    if (known_.count(key.str())) continue;
    std::string message = "unknown key " + quote(key.str()) + (name_.empty() ? "" : " in [" + name_ + "]");
    if (auto suggestion = did_you_mean(key.str(), known)) message += "; did you mean " + quote(*suggestion) + "?";
    problems_.add(key.source(), message);
  }
}

std::optional<toml::table> parse_toml_file(const std::string& path, Problems& problems) {
  std::string text;
  try {
    text = read_regular_file(path, kMaxConfigBytes);
  } catch (const Error& error) {
    problems.add_whole_file(error.what());
    return std::nullopt;
  }
  return parse_toml_text(text, path, problems);
}

std::optional<toml::table> parse_toml_text(std::string_view text, const std::string& path, Problems& problems) {
  try {
    return toml::parse(text, path);
  } catch (const toml::parse_error& error) {
    problems.add(error.source(), escape_invalid_utf8(error.description()));  // it quotes the file: "saw 'f\n'"
    return std::nullopt;
  }
}

void note_positions(const toml::table& table, const std::string& prefix,
                    std::map<std::string, std::pair<uint32_t, uint32_t>>& out) {
  for (const auto& [key, value] : table) {
    const std::string path = prefix + std::string(key.str());
    out[path] = {key.source().begin.line, key.source().begin.column};
    if (const toml::table* inner = value.as_table()) note_positions(*inner, path + ".", out);
  }
}

}  // namespace vramd::config
