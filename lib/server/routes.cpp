#include "server/routes.hpp"

#include <array>
#include <string_view>

#include "util/format.hpp"

namespace vramd::server {
namespace {

// A path's parts between its slashes (empty ones skipped), as views of it: the first five (no
// route has more), and how many there are. Made for every request: it allocates nothing.
struct Parts {
  std::array<std::string_view, 5> at;
  size_t count = 0;
  size_t size() const { return count; }
  bool empty() const { return count == 0; }
  std::string_view operator[](size_t i) const { return at[i]; }
};

Parts split_path(std::string_view path) {
  Parts parts;
  for (size_t start = 0; start <= path.size();) {
    size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    if (end > start && parts.count++ < parts.at.size()) parts.at[parts.count - 1] = path.substr(start, end - start);
    start = end + 1;
  }
  return parts;
}

Route refused(int status, std::string endpoint, std::string error) {
  Route route;
  route.endpoint = std::move(endpoint);
  route.status = status;
  route.error = std::move(error);
  return route;
}

Route to(Route::Kind kind, std::string endpoint) {
  Route route;
  route.kind = kind;
  route.endpoint = std::move(endpoint);
  return route;
}

constexpr std::array<const char*, 10> kActions = {"load",   "unload",  "offload", "onload", "forward",
                                                   "lease", "weights", "loras",   "derive", "plan"};

}  // namespace

Route route(const Request& request) {
  const auto parts = split_path(request.path);
  // For refusals alone: a route found costs no message.
  const auto what = [&] { return request.method + " " + quote(request.path); };
  const auto only = [&](const char* method, Route route) {
    if (request.method == method) return route;
    return refused(405, route.endpoint, what() + ": use " + method);
  };
  if (parts.size() == 1 && parts[0] == "metrics") return only("GET", to(Route::Kind::Metrics, "metrics"));
  if (parts.empty() || parts[0] != "v1")
    return refused(404, "unknown", "no such endpoint: " + what() + " (the API is under /v1; see docs/api.md)");
  if (parts.size() == 2) {
    if (parts[1] == "health") return only("GET", to(Route::Kind::Health, "health"));
    if (parts[1] == "status") return only("GET", to(Route::Kind::Status, "status"));
    if (parts[1] == "reload") return only("POST", to(Route::Kind::Reload, "reload"));
    if (parts[1] == "models") return only("GET", to(Route::Kind::List, "list"));
  }
  if (parts.size() < 3 || parts.size() > 4 || parts[1] != "models")
    return refused(404, "unknown", "no such endpoint: " + what() + " (see docs/api.md)");
  if (parts.size() == 3) {  // GET, or DELETE of a derived model
    if (request.method != "GET" && request.method != "DELETE")
      return refused(405, "model", what() + ": use GET (or DELETE, to remove a derived model)");
    Route model = to(request.method == "GET" ? Route::Kind::Model : Route::Kind::Remove, request.method == "GET" ? "model" : "remove");
    model.model = std::string(parts[2]);
    return model;
  }
  for (const char* action : kActions) {
    if (parts[3] != action) continue;
    // A lease is POSTed; GET shows its manifest alone (curl can read it). A plan is only read.
    const bool get_too = parts[3] == "lease" && request.method == "GET";
    Route route = parts[3] == "plan" ? only("GET", to(Route::Kind::Action, action))
                  : get_too          ? to(Route::Kind::Action, action)
                                     : only("POST", to(Route::Kind::Action, action));
    route.model = std::string(parts[2]);
    route.action = action;
    return route;
  }
  return refused(404, "unknown", "no such action " + quote(parts[3]) + " on a model: load, unload, offload, onload, forward, lease, weights, loras, derive, plan");
}

}  // namespace vramd::server
