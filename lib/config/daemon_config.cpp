#include "config/daemon_config.hpp"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "config/toml_schema.hpp"
#include "util/error.hpp"

namespace vramd::config {
namespace fs = std::filesystem;

bool is_device_name(const std::string& device) {
  if (device == "cpu") return true;
  if (device.rfind("cuda:", 0) != 0 || device.size() == 5) return false;
  return device.find_first_not_of("0123456789", 5) == std::string::npos;
}

std::string canonical_device(const std::string& device) { return device == "cuda" ? "cuda:0" : device; }

DaemonConfig default_daemon_config() {
  DaemonConfig config;
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  config.socket = runtime && *runtime ? std::string(runtime) + "/vramd.sock"
                                      : "/tmp/vramd-" + std::to_string(::getuid()) + ".sock";
  config.models = "models";
  return config;
}

DaemonConfig find_daemon_config(const std::string& path) {
  if (!path.empty()) return load_daemon_config(path);
  if (fs::exists("configs/vramd.toml")) return load_daemon_config("configs/vramd.toml");
  return default_daemon_config();
}

DaemonConfig load_daemon_config(const std::string& path) {
  Problems problems(path);
  DaemonConfig config = default_daemon_config();
  config.path = path;
  auto document = parse_toml_file(path, problems);
  problems.throw_if_any();

  const fs::path folder = fs::absolute(path).parent_path();
  auto resolve = [&](const std::string& relative) { return (folder / relative).lexically_normal().string(); };

  TableReader root(*document, "", problems);
  if (auto socket = root.string("socket")) config.socket = resolve(*socket);
  config.models = resolve(root.string("models").value_or(config.models));
  for (const auto& converters : root.strings("converters").value_or(std::vector<std::string>{}))
    config.converters.push_back(resolve(converters));
  if (auto level = root.string("log_level")) {
    if (*level == "error" || *level == "warn" || *level == "info" || *level == "debug")
      config.log_level = *level;
    else
      root.bad_value("log_level", "expected one of error, warn, info, debug");
  }
  if (auto budgets = root.table("budgets")) {
    for (auto device : budgets->keys()) {
      if (!is_device_name(canonical_device(std::string(device)))) {
        budgets->node(device);
        budgets->bad_value(device, "not a device; expected \"cpu\", \"cuda\" or \"cuda:N\"");
        continue;
      }
      if (auto size = budgets->size(device)) config.budgets[canonical_device(std::string(device))] = *size;
    }
    budgets->finish();
  }
  if (auto defaults = root.table("defaults")) {
    if (auto keep_alive = defaults->duration("keep_alive")) config.keep_alive = *keep_alive;
    defaults->finish();
  }
  root.finish();
  problems.throw_if_any();
  return config;
}

}  // namespace vramd::config
