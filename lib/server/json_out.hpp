// Two sinks for the JSON the daemon answers with, one interface: JsonOut writes the text
// straight into a string, for answers made often (GET /v1/status: building an nlohmann tree and
// dumping it cost more than the rest of the request, docs/benchmarks.md); JsonTree builds the
// nlohmann::json the other answers are made of. A shape written once, as a template on the
// sink (server/status.cpp), comes out the same from both.
//
//   out.object().field("name", "m").key("leases").array().value(1).end().end();
#pragma once

#include <array>
#include <charconv>
#include <concepts>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vramd::server {

class JsonOut {
 public:
  explicit JsonOut(std::string& out) : out_(out) {}

  JsonOut& object() { return open('{'); }
  JsonOut& array() { return open('['); }
  JsonOut& end();  // closes the innermost object or array
  JsonOut& key(std::string_view key);

  JsonOut& value(std::string_view text);
  JsonOut& value(const char* text) { return value(std::string_view(text)); }
  JsonOut& value(const std::string& text) { return value(std::string_view(text)); }
  JsonOut& value(bool b) { return raw(b ? "true" : "false"); }
  JsonOut& value(std::nullptr_t) { return raw("null"); }
  template <std::integral T>
  JsonOut& value(T n) {
    char text[24];
    return raw(std::string_view(text, std::to_chars(text, text + sizeof text, n).ptr - text));
  }
  JsonOut& value(double d);
  JsonOut& value(const nlohmann::json& j);  // a part made as a tree, written in place
  template <class T>
  JsonOut& value(const std::optional<T>& v) { return v ? value(*v) : value(nullptr); }

  template <class T>
  JsonOut& field(std::string_view name, const T& v) { return key(name).value(v); }

 private:
  JsonOut& open(char bracket);
  JsonOut& raw(std::string_view text);
  void separate();  // the comma before an array's next value or an object's next key

  std::string& out_;
  struct Open {
    char close;  // '}' or ']'
    bool empty;  // nothing in it yet
  };
  // The objects and arrays open, innermost last: held in place (a status request makes one
  // JsonOut), as deep as any shape the daemon writes and more.
  std::array<Open, 32> open_;
  size_t depth_ = 0;
  bool keyed_ = false;       // a key was written; its value comes next
};

class JsonTree {
 public:
  JsonTree& object() { return open(nlohmann::json::object()); }
  JsonTree& array() { return open(nlohmann::json::array()); }
  JsonTree& end() { open_.pop_back(); return *this; }
  JsonTree& key(std::string_view key) { key_ = key; return *this; }
  template <class T>
  JsonTree& value(T&& v) { place(nlohmann::json(std::forward<T>(v))); return *this; }
  template <class T>
  JsonTree& value(const std::optional<T>& v) { place(v ? nlohmann::json(*v) : nlohmann::json(nullptr)); return *this; }
  template <class T>
  JsonTree& field(std::string_view name, const T& v) { return key(name).value(v); }

  nlohmann::json take() { return std::move(root_); }

 private:
  JsonTree& open(nlohmann::json empty) { open_.push_back(&place(std::move(empty))); return *this; }
  nlohmann::json& place(nlohmann::json v);

  nlohmann::json root_;
  std::vector<nlohmann::json*> open_;  // stable: a container is not added to while one inside it is open
  std::string key_;
};

}  // namespace vramd::server
