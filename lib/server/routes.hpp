// Which endpoint a request is for, from its method and path alone (docs/api.md). No state, no
// libuv: the daemon acts on the route, and the fuzzer checks that any request gets one.
#pragma once

#include <string>

#include "server/request_parser.hpp"

namespace vramd::server {

struct Route {
  enum class Kind { Metrics, Health, Status, Reload, List, Model, Remove, Action, Refused };
  Kind kind = Kind::Refused;
  std::string endpoint;  // the requests counter's label: "health", "list", "load", "unknown", ...
  std::string model;     // Model, Remove and Action: the name in the path, as sent
  std::string action;    // Action: "load", "unload", ... "plan" (routes.cpp kActions)
  int status = 0;        // Refused: 404 or 405
  std::string error;     // Refused: why, with the request's own text escaped (valid UTF-8)
};

Route route(const Request& request);

}  // namespace vramd::server
