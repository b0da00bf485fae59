// The daemon's config file (configs/vramd.toml). Schema: docs/config.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace vramd::config {

struct DaemonConfig {
  std::string path;                     // the file read; empty for built-in defaults
  std::string socket;                   // Unix socket path
  std::string models;                   // folder of model configs
  std::vector<std::string> converters;  // folders converter scripts may come from
  std::string log_level = "info";       // error | warn | info | debug
  std::map<std::string, uint64_t> budgets;  // device ("cpu", "cuda:0") -> bytes
  std::optional<std::chrono::milliseconds> keep_alive = std::chrono::minutes(10);  // nullopt: forever
};

// Relative paths in the file are resolved against its folder. Throws Error listing every
// problem found, each with file, line and column.
DaemonConfig load_daemon_config(const std::string& path);

// Defaults when there is no config file: socket in $XDG_RUNTIME_DIR (else /tmp), no budgets.
DaemonConfig default_daemon_config();

// For offline tools: `path` when given, else configs/vramd.toml when it exists, else defaults.
DaemonConfig find_daemon_config(const std::string& path);

// "cuda" is "cuda:0"; other names are returned as they are.
std::string canonical_device(const std::string& device);

// "cpu" or "cuda:N" (after canonical_device).
bool is_device_name(const std::string& device);

}  // namespace vramd::config
