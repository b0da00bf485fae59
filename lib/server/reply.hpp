// JSON answers, and the one shape of every error: {"error": "..."}.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "server/http.hpp"

namespace vramd::server {

inline void respond_json(Exchange& exchange, int status, const nlohmann::json& body) {
  exchange.respond(status, "application/json", body.dump() + "\n");
}

inline void respond_error(Exchange& exchange, int status, const std::string& message) {
  respond_json(exchange, status, {{"error", message}});
}

}  // namespace vramd::server
