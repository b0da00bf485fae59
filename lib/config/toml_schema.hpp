// Reading a TOML table against a schema, for the config loaders only (it pulls in toml++).
//
// Every getter marks its key as known; finish() reports the keys nobody asked for, with the
// nearest known key as a suggestion. Problems are collected, not thrown one at a time, so that
// a user sees every mistake in a file at once; each names the file, line, column and key.
#pragma once

#include <toml++/toml.h>

#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::config {

class Problems {
 public:
  explicit Problems(const std::string& file) : file_(escape_invalid_utf8(file)) {}
  const std::string& file() const { return file_; }
  void add(const toml::source_region& where, const std::string& message);
  void add_whole_file(const std::string& message);  // `message` names the file itself
  bool empty() const { return lines_.empty(); }
  // Throws Error with one line per problem, in the order they stand in the file.
  void throw_if_any() const;

 private:
  struct Line {
    uint32_t line, column;
    std::string text;
  };
  std::string file_;
  std::vector<Line> lines_;
};

class TableReader {
 public:
  // `name` is the table's dotted path as users write it ("" for the root, "vram").
  TableReader(const toml::table& table, std::string name, Problems& problems);

  std::optional<std::string> string(std::string_view key);
  std::optional<bool> boolean(std::string_view key);
  // A string or an array of strings.
  std::optional<std::vector<std::string>> strings(std::string_view key);
  std::optional<TableReader> table(std::string_view key);
  // An array of tables ([[lora]]), each named "key[N]" (1-based) in messages.
  std::vector<TableReader> tables(std::string_view key);
  // A number (an integer or a float) in [min, max].
  std::optional<double> number(std::string_view key, double min, double max);
  // An integer in [min, max], or an array of them.
  std::optional<int64_t> integer(std::string_view key, int64_t min, int64_t max);
  std::optional<std::vector<int64_t>> integers(std::string_view key, int64_t min, int64_t max);
  // A size: a string such as "6GiB", or an integer number of bytes.
  std::optional<uint64_t> size(std::string_view key);
  // A duration such as "10m"; "-1" is forever. Absent: nullopt; forever: an empty inner value.
  std::optional<std::optional<std::chrono::milliseconds>> duration(std::string_view key);
  // The node itself, for values whose shape the caller checks (e.g. inline tables).
  const toml::node* node(std::string_view key);

  // Reports a value as wrong: "<file>:<line>:<col>: <key> = <value>: <message>".
  void bad_value(std::string_view key, const std::string& message);
  void problem(const std::string& message) { problems_.add(table_.source(), message); }
  std::string qualified(std::string_view key) const;
  const toml::table& raw() const { return table_; }
  std::vector<std::string_view> keys() const;

  // Reports the keys no getter asked for.
  void finish();

 private:
  const toml::table& table_;
  std::string name_;
  Problems& problems_;
  std::set<std::string, std::less<>> known_;
};

// Parses a file, or reports its syntax error in `problems` and returns nullopt.
std::optional<toml::table> parse_toml_file(const std::string& path, Problems& problems);
std::optional<toml::table> parse_toml_text(std::string_view text, const std::string& path, Problems& problems);

// {line, column} of every key in `table` and the tables within it, by its dotted path under
// `prefix` ("vram.onload.device"), into `out`.
void note_positions(const toml::table& table, const std::string& prefix,
                    std::map<std::string, std::pair<uint32_t, uint32_t>>& out);


}  // namespace vramd::config
