// The daemon's config file (configs/vramd.toml). Schema: docs/config.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace vramd::config {

// What a client may ask of the daemon; every refusal is a clear HTTP error.
struct ServerLimits {
  uint64_t max_header_bytes = 64 << 10;     // request line and headers
  uint64_t max_body_bytes = uint64_t{2} << 30;
  uint32_t max_connections = 256;
  uint64_t max_unsent_bytes = 4 << 20;  // answers a connection has not taken before it is read again
  std::chrono::milliseconds idle_timeout{60'000};     // a connection with no request under way
  std::chrono::milliseconds request_timeout{60'000};  // to receive one whole request
  uint32_t queue_length = 64;                         // requests waiting for one model
  std::chrono::milliseconds shutdown_grace{10'000};   // for work in flight at SIGTERM
};

// Who may connect besides the daemon's own user, checked per connection (SO_PEERCRED).
struct AccessConfig {
  std::vector<uint32_t> uids;
  std::string group;   // a group name; empty: none
  uint32_t gid = 0;    // the group's id, when a group is named
};

struct DaemonConfig {
  std::string path;                     // the file read; empty for built-in defaults
  std::string looked_for;               // built-in defaults: the file that was looked for and not found
  std::string socket;                   // Unix socket path
  std::string tcp;                      // "127.0.0.1:PORT" also listens on loopback TCP; empty: off
  std::string models;                   // folder of model configs
  std::vector<std::string> converters;  // folders converter scripts may come from
  std::vector<std::string> architectures;  // folders of family files beside the shipped ones
  // The Python that writes transformers' conversion as a converter (converter = "transformers"):
  // one with vramd's package and transformers 5; a path, or a name looked up on PATH.
  std::string python = "python3";
  std::string log_level = "info";       // error | warn | info | debug
  std::string log_file;                 // also log here (appended); empty: stderr (the journal) only
  std::map<std::string, uint64_t> budgets;  // device ("cpu", "cuda:0") -> bytes
  std::optional<std::chrono::milliseconds> keep_alive = std::chrono::minutes(10);  // nullopt: forever
  AccessConfig access;
  ServerLimits limits;
  // [group]: ranks this daemon starts on this machine, as copies of itself, for models with
  // [partition] (rank 0 serves; the others follow it). torchrun's variables override it.
  int world_size = 1;
  // [group] interface: the network interface whose address the ranks' Gloo connections use on
  // this host; empty: the one that reaches MASTER_ADDR. GLOO_SOCKET_IFNAME overrides it.
  std::string interface;
};

// Relative paths in the file are resolved against its folder. Throws Error listing every
// problem found, each with file, line and column.
DaemonConfig load_daemon_config(const std::string& path);

// Defaults when there is no config file: no budgets, and the socket in a folder of its own
// that only its user may enter: $XDG_RUNTIME_DIR/vramd/vramd.sock, else /tmp/vramd-UID/vramd.sock.
DaemonConfig default_daemon_config();

// For offline tools: `path` when given, else configs/vramd.toml when it exists, else defaults
// (which say what was looked for).
DaemonConfig find_daemon_config(const std::string& path);

// "cuda" is "cuda:0"; other names are returned as they are.
std::string canonical_device(const std::string& device);

// "cpu" or "cuda:N" (after canonical_device).
bool is_device_name(const std::string& device);

// Where a state's weights are, parsed once from the config: disk (released, read again from
// the checkpoint when needed), host memory, or a CUDA device.
struct Device {
  enum class Kind { Disk, Cpu, Cuda };
  Kind kind = Kind::Cpu;
  int index = 0;  // of a CUDA device

  // "disk", "cpu", "cuda" (cuda:0) or "cuda:N"; none for anything else.
  static std::optional<Device> parse(const std::string& name);
  // The same for names known to be right (tests, defaults); throws Error for others.
  static Device named(const std::string& name);

  bool is_disk() const { return kind == Kind::Disk; }
  bool is_cpu() const { return kind == Kind::Cpu; }
  std::string str() const;  // "disk", "cpu", "cuda:N": the key of its budget
  bool operator==(const Device&) const = default;
};

}  // namespace vramd::config
