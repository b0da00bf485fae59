// vramd's long-running part: the event loop, the HTTP API (docs/api.md) over the registry,
// signals and shutdown.
#pragma once

#include <memory>

#include "config/daemon_config.hpp"

namespace vramd::server {

// Serves until SIGTERM or SIGINT, then stops accepting, lets work in flight finish within the
// grace period (loads are cancelled), frees the models, removes the socket and returns 0.
// Throws Error when it cannot start (e.g. another daemon serves the socket).
int serve(const config::DaemonConfig& config);

}  // namespace vramd::server
