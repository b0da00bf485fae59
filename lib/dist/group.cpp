// The group (its TCPStore) and the communicators (Gloo process groups under prefixes of it).
// The wheel's ProcessGroupGloo.hpp needs Gloo's headers, which come from Debian's libgloo-dev.
#include "dist/group.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "config/units.hpp"
#include "dist/communicator.hpp"
#include "dist/network.hpp"
#include "util/format.hpp"

namespace vramd::dist {
namespace {

// Gloo's own exceptions (an I/O error when a peer vanishes) are not c10::Errors.
std::string text_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (!value || !*value) return std::nullopt;
  return std::string(value);
}

int64_t env_integer(const char* name, int64_t min, int64_t max) {
  const auto value = env(name);
  if (!value) throw Error(std::string("environment: ") + name + " is not set (WORLD_SIZE is, so it must be too)");
  size_t used = 0;
  int64_t number = 0;
  try {
    number = std::stoll(*value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value->size() || number < min || number > max)
    throw Error(std::string("environment: ") + name + "=" + *value + " is not an integer in [" + std::to_string(min) +
                ", " + std::to_string(max) + "]");
  return number;
}

std::string host_name() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

// Gone, or a zombie its parent has not reaped yet. A peer's sockets close while it exits, a
// moment before it is a zombie, so a failure noticed then waits for that moment a little.
bool has_exited(pid_t pid) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && (line[paren + 2] == 'Z' || line[paren + 2] == 'X')) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

std::optional<GroupOptions> options_from_environment(const config::DaemonConfig& daemon) {
  if (!env("WORLD_SIZE")) return std::nullopt;
  GroupOptions options;
  options.world_size = static_cast<int>(env_integer("WORLD_SIZE", 1, 4096));
  options.rank = static_cast<int>(env_integer("RANK", 0, options.world_size - 1));
  options.master_addr = env("MASTER_ADDR").value_or("127.0.0.1");
  if (env("MASTER_PORT")) options.master_port = static_cast<uint16_t>(env_integer("MASTER_PORT", 1, 65535));
  if (auto interface = env("GLOO_SOCKET_IFNAME")) {
    options.interface = *interface;
    options.interface_setting = "GLOO_SOCKET_IFNAME";
  } else if (!daemon.interface.empty()) {
    options.interface = daemon.interface;
    options.interface_setting = daemon.path + ": [group] interface";
  }
  return options;
}

struct Group::Impl {
  c10::intrusive_ptr<c10d::Store> store;
};

Group::Group(GroupOptions options, std::string address, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), address_(std::move(address)), impl_(std::move(impl)) {}
Group::~Group() = default;

std::shared_ptr<Group> Group::join(const GroupOptions& options) {
  const std::string me = "rank " + std::to_string(options.rank) + " of " + std::to_string(options.world_size);
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  const std::string master = "MASTER_ADDR=" + options.master_addr;
  std::string address;
  try {
    address = options.interface.empty() ? address_toward(options.master_addr, options.master_port)
                                        : interface_address(options.interface);
  } catch (const Error& e) {
    throw Error(me + ": " +
                (options.interface.empty() ? master : options.interface_setting + " = " + quote(options.interface)) +
                ": " + e.what());
  }
  // Under torchrun, its agent on rank 0's host serves the store already, and says so.
  const bool serves = options.rank == 0 && env("TORCHELASTIC_USE_AGENT_STORE") != "True";
  c10d::TCPStoreOptions store_options;
  store_options.port = options.master_port;
  store_options.isServer = serves;
  store_options.numWorkers = options.world_size;
  store_options.waitWorkers = false;  // ranks join per model, each with its own timeout
  store_options.timeout = options.timeout;
  const std::string port = "MASTER_PORT=" + std::to_string(options.master_port);
  // Rank 0 listens first, then every rank waits until MASTER_ADDR answers (rank 0 its own
  // listener there): c10d retries past its timeout, by seconds, where this stops at it.
  if (serves) {
    try {
      store_options.masterListenFd = listen_on_port(options.master_port);
    } catch (const Error& e) {
      throw Error(me + ": cannot serve the group's store: " + e.what() + " (" + port + ": choose a free port)");
    }
  }
  try {
    wait_until_reachable(options.master_addr, options.master_port, deadline);
  } catch (const Error& e) {
    if (store_options.masterListenFd) close(*store_options.masterListenFd);
    const std::string within = " within " + config::format_duration(options.timeout) + " (" + e.what() + "): ";
    throw Error(serves
                    ? me + " serves the group's store on " + port + " but does not reach it at " + master + within +
                          "MASTER_ADDR must be an address of this host (" + host_name() + ") that the other ranks reach"
                    : me + " cannot reach the group's store at " + master + " " + port + within +
                          "is rank 0 running, and is MASTER_ADDR an address of its host that this host (" +
                          host_name() + ") reaches?");
  }
  auto impl = std::make_unique<Impl>();
  try {
    impl->store = c10::make_intrusive<c10d::TCPStore>(options.master_addr, store_options);
  } catch (const std::exception& e) {
    throw Error(me + ": " + (serves ? "cannot serve the group's store at " : "cannot reach the group's store at ") +
                master + " " + port + ": " + text_of(e));
  }
  return std::shared_ptr<Group>(new Group(options, std::move(address), std::move(impl)));
}

std::string Group::describe_address() const {
  const std::string why = options_.interface.empty() ? "the address that reaches MASTER_ADDR=" + options_.master_addr
                                                     : "the address of interface " + quote(options_.interface) + " (" +
                                                           options_.interface_setting + ")";
  return "rank " + std::to_string(rank()) + " of " + std::to_string(size()) + " on " + host_name() + ": Gloo uses " +
         address_ + ", " + why;
}

void Group::set(const std::string& key, std::string_view value) {
  impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Group::get(const std::string& key, std::chrono::milliseconds timeout) {
  try {
    impl_->store->wait({key}, timeout);
    const auto bytes = impl_->store->get(key);
    return std::string(bytes.begin(), bytes.end());
  } catch (const c10::DistNetworkError& e) {
    throw Error("lost the group's store on " + options_.master_addr + ":" + std::to_string(options_.master_port) + ": " +
                text_of(e));
  } catch (const std::exception& e) {
    throw Timeout("the group's store: no " + quote(key) + " within " + config::format_duration(timeout) + ": " + text_of(e));
  }
}

void Group::erase(const std::string& key) {
  try {
    impl_->store->deleteKey(key);
  } catch (const std::exception& e) {
    throw Error("the group's store: " + text_of(e));
  }
}

int64_t Group::add(const std::string& key, int64_t amount) {
  try {
    return impl_->store->add(key, amount);
  } catch (const std::exception& e) {
    throw Error("the group's store: " + text_of(e));
  }
}

// --- Communicator ---

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::Store> store;  // prefixed with the name
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
};

struct Communicator::Pending::Work {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::vector<at::Tensor>> chunks;  // kept alive until the gather is done
  std::string step;  // when set, a failure names the ranks that have not marked it
};

namespace {

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

}  // namespace

Communicator::Communicator(std::shared_ptr<Group> group, std::string name, std::chrono::milliseconds timeout)
    : group_(std::move(group)), name_(std::move(name)), impl_(std::make_unique<Impl>()) {
  impl_->store = c10::make_intrusive<c10d::PrefixStore>(name_, group_->impl().store);
  mark("joined");
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  try {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(group_->address()));
    impl_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, rank(), size(), options);
  } catch (const std::exception& e) {
    const auto absent = missing("joined");
    if (!absent.empty())
      throw RankFailure(name_ + ": " + ranks_text(absent) + " of " + std::to_string(size()) + " did not join within " +
                  config::format_duration(timeout) + " (is a process running with RANK=" + std::to_string(absent.front()) +
                  " and WORLD_SIZE=" + std::to_string(size()) + "?)");
    fail("connecting the ranks", text_of(e));
  }
}

Communicator::~Communicator() = default;

// Each mark holds the rank's host and process id, so that a failure can say which rank exited.
void Communicator::mark(const std::string& step) {
  const std::string who = host_name() + " " + std::to_string(getpid());
  impl_->store->set(step + "/" + std::to_string(rank()), std::vector<uint8_t>(who.begin(), who.end()));
}

// "rank 1 (pid 4242) has exited" for the ranks on this host whose process is gone.
std::string Communicator::exited() {
  std::string text;
  for (int r = 0; r < size(); ++r) {
    if (r == rank()) continue;
    try {
      const std::string key = "joined/" + std::to_string(r);
      if (!impl_->store->check({key})) continue;
      const auto bytes = impl_->store->get(key);
      const std::string who(bytes.begin(), bytes.end());
      const auto space = who.rfind(' ');
      if (space == std::string::npos || who.substr(0, space) != host_name()) continue;
      const pid_t pid = static_cast<pid_t>(std::stol(who.substr(space + 1)));
      if (has_exited(pid))
        text += (text.empty() ? "" : ", ") + ("rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") has exited");
    } catch (const std::exception&) {
    }
  }
  return text;
}

std::vector<int> Communicator::missing(const std::string& step) {
  std::vector<int> absent;
  for (int r = 0; r < size(); ++r) {
    try {
      if (!impl_->store->check({step + "/" + std::to_string(r)})) absent.push_back(r);
    } catch (const c10::Error&) {
      absent.push_back(r);
    }
  }
  return absent;
}

void Communicator::fail(const std::string& during, const std::string& cause, const std::string& step) {
  std::string who;
  try {
    const auto absent = step.empty() ? std::vector<int>{} : missing(step);
    if (!absent.empty()) who = ranks_text(absent) + " did not finish " + step;
    const std::string gone = exited();
    if (!gone.empty()) who += (who.empty() ? "" : ": ") + gone;
  } catch (const std::exception&) {
  }
  if (who.empty()) who = "a rank exited or stopped answering";
  throw RankFailure(name_ + ": " + during + " failed on rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
              ": " + who + " (" + cause + ")");
}

// One broadcast per rank, each straight into that rank's chunk of `output`: Gloo's own
// all-gather goes through a temporary as large as the output, which would double the memory a
// gathered layer takes.
Communicator::Pending Communicator::all_gather(const at::Tensor& output, const at::Tensor& shard) {
  Pending pending;
  pending.owner_ = this;
  pending.work_ = std::make_shared<Pending::Work>();
  // As bytes, so that every dtype (float8 too) travels the same way.
  const at::Tensor bytes = output.view(at::kByte);
  const int64_t chunk = shard.view(at::kByte).numel();
  try {
    for (int r = 0; r < size(); ++r) {
      auto& tensors = pending.work_->chunks.emplace_back(1, bytes.narrow(0, r * chunk, chunk));
      if (r == rank()) tensors[0].copy_(shard.view(at::kByte));
      c10d::BroadcastOptions options;
      options.rootRank = r;
      pending.work_->works.push_back(impl_->gloo->broadcast(tensors, options));
    }
  } catch (const std::exception& e) {
    fail("a gather", text_of(e));
  }
  return pending;
}

void Communicator::Pending::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  try {
    for (auto& each : work->works) each->wait();
  } catch (const std::exception& e) {
    owner_->fail("a gather", text_of(e), work->step);
  }
}

std::vector<int64_t> Communicator::all_gather_values(int64_t value, const std::string& step) {
  mark(step);
  const at::Tensor shard = at::full({1}, value, at::kLong);
  const at::Tensor output = at::empty({size()}, at::kLong);
  auto pending = all_gather(output, shard);
  pending.work_->step = step;
  pending.wait();
  return {output.data_ptr<int64_t>(), output.data_ptr<int64_t>() + size()};
}

}  // namespace vramd::dist
