#include "config/daemon_config.hpp"

#include <arpa/inet.h>
#include <grp.h>
#include <net/if.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "config/toml_schema.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::config {
namespace fs = std::filesystem;

bool is_device_name(const std::string& device) {
  if (device == "cpu") return true;
  if (device.rfind("cuda:", 0) != 0 || device.size() == 5) return false;
  return device.find_first_not_of("0123456789", 5) == std::string::npos;
}

std::string canonical_device(const std::string& device) { return device == "cuda" ? "cuda:0" : device; }

std::optional<Device> Device::parse(const std::string& name) {
  if (name == "disk") return Device{Kind::Disk, 0};
  const std::string canonical = canonical_device(name);
  if (!is_device_name(canonical)) return std::nullopt;
  if (canonical == "cpu") return Device{Kind::Cpu, 0};
  const std::string index = canonical.substr(5);
  if (index.size() > 4) return std::nullopt;  // no machine has 10,000 GPUs
  return Device{Kind::Cuda, std::stoi(index)};
}

Device Device::named(const std::string& name) {
  if (auto device = parse(name)) return *device;
  throw Error("unknown device " + quote(name) + " (disk, cpu, cuda, cuda:N)");
}

std::string Device::str() const {
  switch (kind) {
    case Kind::Disk: return "disk";
    case Kind::Cpu: return "cpu";
    case Kind::Cuda: return "cuda:" + std::to_string(index);
  }
  return "?";
}

namespace {

// "lo, eth0": the names `ip link` lists.
std::string interface_names() {
  std::string names;
  if (struct if_nameindex* all = if_nameindex()) {
    for (const struct if_nameindex* each = all; each->if_index != 0; ++each)
      names += (names.empty() ? "" : ", ") + std::string(each->if_name);
    if_freenameindex(all);
  }
  return names;
}

}  // namespace

DaemonConfig default_daemon_config() {
  DaemonConfig config;
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  config.socket = runtime && *runtime ? std::string(runtime) + "/vramd/vramd.sock"
                                      : "/tmp/vramd-" + std::to_string(::getuid()) + "/vramd.sock";
  config.models = "models";
  return config;
}

DaemonConfig find_daemon_config(const std::string& path) {
  if (!path.empty()) return load_daemon_config(path);
  if (fs::exists("configs/vramd.toml")) return load_daemon_config("configs/vramd.toml");
  DaemonConfig defaults = default_daemon_config();
  defaults.looked_for = fs::absolute("configs/vramd.toml").string();
  return defaults;
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
  // Folders the daemon looks in: one that is not there is a typo, said now rather than when a
  // model first looks in it.
  const auto folders = [&](const char* key, std::vector<std::string>& into) {
    for (const auto& folder : root.strings(key).value_or(std::vector<std::string>{})) {
      into.push_back(resolve(folder));
      if (std::error_code ec; !fs::is_directory(into.back(), ec))
        root.bad_value(key, quote(folder) + " is not a folder (" + quote(into.back()) + ")");
    }
  };
  folders("converters", config.converters);
  folders("architectures", config.architectures);
  if (auto python = root.string("python")) {
    if (python->empty()) root.bad_value("python", "names no program");
    else config.python = python->find('/') == std::string::npos ? *python : resolve(*python);
  }
  if (auto tcp = root.string("tcp")) {
    const auto colon = tcp->rfind(':');
    in_addr address{};
    const std::string host = tcp->substr(0, colon == std::string::npos ? 0 : colon);
    const std::string port = colon == std::string::npos ? "" : tcp->substr(colon + 1);
    if (colon == std::string::npos || inet_pton(AF_INET, host.c_str(), &address) != 1 ||
        port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) > 65535)
      root.bad_value("tcp", "expected \"127.0.0.1:PORT\"");
    else if ((ntohl(address.s_addr) >> 24) != 127)
      root.bad_value("tcp", "only a loopback address (127.x.x.x) may be used: TCP clients cannot be identified");
    else
      config.tcp = *tcp;
  }
  if (auto level = root.string("log_level")) {
    if (*level == "error" || *level == "warn" || *level == "info" || *level == "debug")
      config.log_level = *level;
    else
      root.bad_value("log_level", "expected one of error, warn, info, debug");
  }
  if (auto log_file = root.string("log_file")) config.log_file = resolve(*log_file);
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
  if (auto access = root.table("access")) {
    for (int64_t uid : access->integers("uids", 0, UINT32_MAX).value_or(std::vector<int64_t>{}))
      config.access.uids.push_back(static_cast<uint32_t>(uid));
    if (auto group = access->string("group")) {
      if (const ::group* entry = ::getgrnam(group->c_str())) {
        config.access.group = *group;
        config.access.gid = entry->gr_gid;
      } else {
        access->bad_value("group", "no such group on this machine");
      }
    }
    access->finish();
  }
  if (auto limits = root.table("limits")) {
    ServerLimits& l = config.limits;
    l.max_header_bytes = limits->size("max_header_size").value_or(l.max_header_bytes);
    l.max_body_bytes = limits->size("max_body_size").value_or(l.max_body_bytes);
    l.max_unsent_bytes = limits->size("max_unsent_size").value_or(l.max_unsent_bytes);
    l.max_connections = static_cast<uint32_t>(limits->integer("max_connections", 1, 65536).value_or(l.max_connections));
    l.queue_length = static_cast<uint32_t>(limits->integer("queue_length", 1, 1 << 20).value_or(l.queue_length));
    const auto finite = [&](std::string_view key, std::chrono::milliseconds& into) {
      auto value = limits->duration(key);
      if (!value) return;
      if (*value && **value > std::chrono::milliseconds(0)) into = **value;
      else limits->bad_value(key, "expected a positive duration such as \"30s\"");
    };
    finite("idle_timeout", l.idle_timeout);
    finite("request_timeout", l.request_timeout);
    finite("shutdown_grace", l.shutdown_grace);
    if (l.max_header_bytes < 1024 || l.max_header_bytes > 80 * 1024)  // http-parser's own bound is 80KiB
      limits->bad_value("max_header_size", "expected from 1KiB to 80KiB");
    limits->finish();
  }
  if (auto group = root.table("group")) {
    config.world_size = static_cast<int>(group->integer("world_size", 1, 256).value_or(1));
    if (auto interface = group->string("interface")) {
      if (if_nametoindex(interface->c_str()) == 0)
        group->bad_value("interface", "no such network interface on this machine (it has " + interface_names() + ")");
      else
        config.interface = *interface;
    }
    group->finish();
  }
  root.finish();
  problems.throw_if_any();
  return config;
}

}  // namespace vramd::config
