#include "server/json_out.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <stdexcept>
#include <string>

#include "server/reply.hpp"

namespace vramd::server {

void JsonOut::separate() {
  if (keyed_) {
    keyed_ = false;
    return;
  }
  if (depth_ == 0) return;
  Open& in = open_[depth_ - 1];
  if (!in.empty) out_ += ',';
  in.empty = false;
}

JsonOut& JsonOut::open(char bracket) {
  if (depth_ == open_.size()) throw std::logic_error("JsonOut: more than " + std::to_string(open_.size()) + " levels open");
  separate();
  out_ += bracket;
  open_[depth_++] = {bracket == '{' ? '}' : ']', true};
  return *this;
}

JsonOut& JsonOut::end() {
  out_ += open_[--depth_].close;
  return *this;
}

JsonOut& JsonOut::raw(std::string_view text) {
  separate();
  out_ += text;
  return *this;
}

JsonOut& JsonOut::key(std::string_view key) {
  value(key);
  out_ += ':';
  keyed_ = true;
  return *this;
}

JsonOut& JsonOut::value(std::string_view text) {
  // Nothing to escape, nothing that is not ASCII: as it is. Anything else as json_line writes it.
  const bool plain = std::all_of(text.begin(), text.end(), [](char c) {
    return c >= 0x20 && c < 0x7f && c != '"' && c != '\\';
  });
  if (!plain) return value(nlohmann::json(std::string(text)));
  separate();
  out_ += '"';
  out_ += text;
  out_ += '"';
  return *this;
}

JsonOut& JsonOut::value(double d) {
  if (!std::isfinite(d)) return raw("null");  // as nlohmann writes it
  // The shortest text that reads back as `d`, with ".0" on a whole number as nlohmann writes it
  // (so that a reader sees a float, not an int).
  char text[40];
  char* end = std::to_chars(text, text + sizeof text - 2, d).ptr;
  if (std::none_of(text, end, [](char c) { return c == '.' || c == 'e'; })) {
    *end++ = '.';
    *end++ = '0';
  }
  return raw(std::string_view(text, static_cast<size_t>(end - text)));
}

JsonOut& JsonOut::value(const nlohmann::json& j) {
  std::string line = json_line(j);
  line.pop_back();  // its newline
  return raw(line);
}

nlohmann::json& JsonTree::place(nlohmann::json v) {
  if (open_.empty()) return root_ = std::move(v);
  nlohmann::json& in = *open_.back();
  if (in.is_object()) return in[key_] = std::move(v);
  in.push_back(std::move(v));
  return in.back();
}

}  // namespace vramd::server
