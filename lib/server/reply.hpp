// JSON answers, and the one shape of every error: {"error": "..."}.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "server/http.hpp"

namespace vramd::server {

// The one place the daemon's JSON becomes text: a line of it. Strings that are not valid UTF-8
// (a path, a file name or a key from outside that no message escaped) get U+FFFD for each bad
// byte instead of an exception from the serializer.
inline std::string json_line(const nlohmann::json& value) {
  std::string line = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  line += '\n';
  return line;
}

inline void respond_json(Exchange& exchange, int status, const nlohmann::json& body) {
  exchange.respond(status, "application/json", json_line(body));
}

inline void respond_error(Exchange& exchange, int status, const std::string& message) {
  respond_json(exchange, status, {{"error", message}});
}

}  // namespace vramd::server
