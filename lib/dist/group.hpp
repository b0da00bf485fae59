// A group of vramd processes, one per rank, on PyTorch's distributed engine (c10d): rank 0
// serves a TCPStore at MASTER_ADDR:MASTER_PORT (under torchrun, its agent on rank 0's host does),
// the other ranks connect to it, and each model loaded partitioned gets its own Gloo process
// group under a prefix of that store (dist/communicator.hpp). The conventions are torchrun's:
// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. This header is LibTorch-free; the daemon's control
// messages go through the store with set() and get().
//
// Gloo's connections use one address of this host: that of GLOO_SOCKET_IFNAME's interface, else
// of [group] interface's (the daemon config), else the one the kernel's routes choose towards
// MASTER_ADDR, which is loopback only when MASTER_ADDR is (Gloo's own choice, the address the
// host name resolves to, is 127.0.1.1 on Debian, which no other host reaches).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config/daemon_config.hpp"
#include "util/error.hpp"

namespace vramd::dist {

struct GroupOptions {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  std::chrono::milliseconds timeout{60'000};  // to reach the store
  std::string interface;          // Gloo's addresses are this interface's; empty: the one towards master_addr
  std::string interface_setting;  // where it was named, for messages: "GLOO_SOCKET_IFNAME", "FILE: [group] interface"
};

// The group torchrun (or a user) described in the environment, with `daemon`'s [group]
// interface: nullopt when WORLD_SIZE is unset. Throws Error naming the variable that is missing
// or malformed.
std::optional<GroupOptions> options_from_environment(const config::DaemonConfig& daemon);

// A key did not appear in the store in time.
class Timeout : public Error {
 public:
  using Error::Error;
};

// A rank failed or stopped answering (dist/communicator.hpp): not the request's fault.
class RankFailure : public Error {
 public:
  using Error::Error;
};

class Group {
 public:
  // Rank 0 serves the store; the others connect to it, retrying until the timeout. Every rank
  // reaches it at MASTER_ADDR within the timeout, or throws Error naming MASTER_ADDR.
  static std::shared_ptr<Group> join(const GroupOptions& options);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const { return options_.rank; }
  int size() const { return options_.world_size; }
  const GroupOptions& options() const { return options_; }
  // This host's address for Gloo's connections, and a line saying which and why, for the log.
  const std::string& address() const { return address_; }
  std::string describe_address() const;

  void set(const std::string& key, std::string_view value);
  // Waits for the key up to `timeout`; throws Timeout naming it, Error when the store is gone.
  std::string get(const std::string& key, std::chrono::milliseconds timeout);
  void erase(const std::string& key);
  // Atomic counter, for unique names.
  int64_t add(const std::string& key, int64_t amount);

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  Group(GroupOptions options, std::string address, std::unique_ptr<Impl> impl);
  GroupOptions options_;
  std::string address_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vramd::dist
