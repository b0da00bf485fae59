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

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
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

// c10d's store client waits for answers without a timeout of its own (TCPStore::check, and the
// cancel after a wait's timeout), so a store whose host went away without closing the connection
// would hold a rank for good: the kernel closes the connections `connect` opens after `timeout`.
template <typename Connect>
c10::intrusive_ptr<c10d::Store> bounded(const GroupOptions& options, std::chrono::milliseconds timeout,
                                        Connect connect) {
  const auto before = connections_to(options.master_addr, options.master_port);
  c10::intrusive_ptr<c10d::Store> store = connect();
  for (const int fd : connections_to(options.master_addr, options.master_port))
    if (std::find(before.begin(), before.end(), fd) == before.end()) bound_connection(fd, timeout);
  return store;
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
  // Gloo writes to its peers with writev, which raises SIGPIPE where a peer died: a rank would die
  // of it in a gather instead of failing it, naming the rank that is gone.
  signal(SIGPIPE, SIG_IGN);
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
    impl->store = bounded(options, options.timeout,
                          [&] { return c10::make_intrusive<c10d::TCPStore>(options.master_addr, store_options); });
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

namespace {

using Clock = std::chrono::steady_clock;

// Gloo waits five times its timeout for a pair's first connection (gloo/transport/tcp/pair.h: "a
// longer timeout when waiting for initial connect"): a model's ranks are connected with a fifth
// of its [partition] timeout, so that Gloo's wait ends with ours.
constexpr int kGlooConnectWaits = 5;

// How long a failing rank waits for the others to meet the failure too before naming those that
// did not: a gather involves every rank, so the living meet it at about the same moment.
constexpr std::chrono::milliseconds kRollCall{2000};

// What each rank writes with its marks, "HOST PID ADDRESS": who it is, and where Gloo reaches it.
struct Member {
  std::string host;
  pid_t pid = 0;
  std::string address;
};

std::string member_text(const Group& group) {
  return host_name() + " " + std::to_string(getpid()) + " " + group.address();
}

// From the store, so from anywhere: what does not parse stays empty.
Member member_of(const std::string& text) {
  Member member;
  std::istringstream words(text);
  words >> member.host >> member.pid >> member.address;
  return member;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

// What to check when Gloo could not connect the ranks: the addresses they advertised, and what sets them.
std::string reach_advice(const std::vector<Member>& members) {
  const bool hosts =
      std::any_of(members.begin(), members.end(), [&](const Member& m) { return m.host != members[0].host; });
  std::string addresses;
  std::vector<int> loopback;
  for (size_t r = 0; r < members.size(); ++r) {
    addresses += (r ? ", rank " : "rank ") + std::to_string(r) + " at " + members[r].address + " on " + members[r].host;
    if (hosts && is_loopback_address(members[r].address)) loopback.push_back(static_cast<int>(r));
  }
  std::string text = "every rank must reach the others at the addresses they advertised (" + addresses + "): ";
  if (!loopback.empty())
    text += ranks_text(loopback) +
            (loopback.size() == 1 ? " advertised a loopback address" : " advertised loopback addresses") +
            ", which the other hosts do not reach; ";
  return text +
         "where one does not, set GLOO_SOCKET_IFNAME, or [group] interface in the daemon config, to the interface "
         "that does";
}

}  // namespace

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::Store> store;  // a connection of its own, prefixed with the name
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  std::vector<Member> members;  // by rank, once every rank has joined
};

struct Communicator::Pending::Work {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::vector<at::Tensor>> chunks;  // kept alive until the gather is done
  std::string step;  // when set, a failure names the ranks that have not marked it
};

Communicator::Communicator(std::shared_ptr<Group> group, std::string name, std::chrono::milliseconds timeout)
    : group_(std::move(group)), name_(std::move(name)), timeout_(timeout), impl_(std::make_unique<Impl>()) {
  const std::string of = " of " + std::to_string(size());
  try {
    // Its own connection to the store, so that the waits of Gloo's rendezvous end with this
    // model's timeout (its fifth, as Gloo's connections'), not the group's.
    auto connection = bounded(group_->options(), timeout, [&] { return group_->impl().store->clone(); });
    connection->setTimeout(timeout / kGlooConnectWaits);
    impl_->store = c10::make_intrusive<c10d::PrefixStore>(name_, connection);
  } catch (const std::exception& e) {
    throw RankFailure(name_ + ": joining failed on rank " + std::to_string(rank()) + of + ": " + rank0_gone("closed") +
                      " (" + text_of(e) + ")");
  }
  std::vector<std::string> joined;
  for (int r = 0; r < size(); ++r) joined.push_back("joined/" + std::to_string(r));
  try {
    mark("joined");
    impl_->store->wait(joined, timeout);
    for (const auto& key : joined) {
      const auto bytes = impl_->store->get(key);
      impl_->members.push_back(member_of(std::string(bytes.begin(), bytes.end())));
    }
  } catch (const std::exception& e) {
    std::vector<int> absent;
    try {
      absent = missing("joined");
    } catch (const std::exception&) {  // the store is gone: fail() says so
    }
    if (!absent.empty())
      throw RankFailure(name_ + ": " + ranks_text(absent) + of + " did not join within " +
                        config::format_duration(timeout) + " (is a process running with RANK=" +
                        std::to_string(absent.front()) + " and WORLD_SIZE=" + std::to_string(size()) + "?)");
    fail("joining", text_of(e));
  }
  auto options = c10d::ProcessGroupGloo::Options::create(timeout / kGlooConnectWaits);
  try {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(group_->address()));
    impl_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, rank(), size(), options);
  } catch (const std::exception& e) {
    fail("connecting the ranks", text_of(e), {}, reach_advice(impl_->members));
  }
  impl_->store->setTimeout(timeout);
  impl_->gloo->setTimeout(timeout);
}

Communicator::~Communicator() = default;

void Communicator::mark(const std::string& step) {
  const std::string who = member_text(*group_);
  impl_->store->set(step + "/" + std::to_string(rank()), std::vector<uint8_t>(who.begin(), who.end()));
}

std::vector<int> Communicator::missing(const std::string& step) {
  std::vector<int> absent;
  for (int r = 0; r < size(); ++r)
    if (!impl_->store->check({step + "/" + std::to_string(r)})) absent.push_back(r);
  return absent;
}

// Rank 0 serves the group's store (or torchrun's agent beside it): when the store closes or stops
// answering, rank 0 has exited or its host is gone.
std::string Communicator::rank0_gone(const std::string& how) const {
  const auto& options = group_->options();
  std::string who = "rank 0";
  if (!impl_->members.empty()) who += " (" + impl_->members[0].address + " on " + impl_->members[0].host + ")";
  return who + " is gone: the group's store on its host, at MASTER_ADDR=" + options.master_addr +
         " MASTER_PORT=" + std::to_string(options.master_port) + ", " + how;
}

// The other ranks that have not marked "failed" within kRollCall: "rank 1 (pid 4242) has exited"
// for a rank of this host whose process is gone, else "rank 2 (10.0.0.3 on node2) did not answer".
std::string Communicator::unanswered() {
  const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(timeout_, kRollCall);
  std::vector<int> silent;
  for (;;) {
    silent = missing("failed");
    std::erase(silent, rank());
    if (silent.empty() || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::string text;
  for (const int r : silent) {
    const Member* member = static_cast<size_t>(r) < impl_->members.size() ? &impl_->members[r] : nullptr;
    std::string line = "rank " + std::to_string(r);
    if (member && member->host == host_name() && member->pid > 0 && has_exited(member->pid))
      line += " (pid " + std::to_string(member->pid) + ") has exited";
    else
      line += (member ? " (" + member->address + " on " + member->host + ")" : "") + " did not answer";
    text += (text.empty() ? "" : ", ") + line;
  }
  return text;
}

void Communicator::fail(const std::string& during, const std::string& cause, const std::string& step,
                        const std::string& advice) {
  std::string who;
  try {
    mark("failed");
    // Whether the store is there, before the queries a store that went away would hold (bounded()).
    const auto& options = group_->options();
    const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(timeout_, kRollCall);
    if (const std::string why = try_reach(options.master_addr, options.master_port, deadline); !why.empty()) {
      who = rank0_gone("does not answer (" + why + ")");
    } else {
      const auto absent = step.empty() ? std::vector<int>{} : missing(step);
      if (!absent.empty()) who = ranks_text(absent) + " did not finish " + step;
      const std::string silent = unanswered();
      if (!silent.empty()) who += (who.empty() ? "" : ": ") + silent;
      if (who.empty()) who = "the other ranks failed too";
    }
  } catch (const c10::DistNetworkError& e) {
    who = rank0_gone("closed (" + text_of(e) + ")");
  } catch (const std::exception& e) {  // the store did not answer in time
    who = "the group's store did not answer (" + text_of(e) + ")";
  }
  throw RankFailure(name_ + ": " + during + " failed on rank " + std::to_string(rank()) + " of " +
                    std::to_string(size()) + ": " + who + " (" + cause + ")" + (advice.empty() ? "" : "; " + advice));
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
  try {
    mark(step);
  } catch (const std::exception& e) {  // the store is gone: fail() names rank 0
    fail("a gather", text_of(e), step);
  }
  const at::Tensor shard = at::full({1}, value, at::kLong);
  const at::Tensor output = at::empty({size()}, at::kLong);
  auto pending = all_gather(output, shard);
  pending.work_->step = step;
  pending.wait();
  return {output.data_ptr<int64_t>(), output.data_ptr<int64_t>() + size()};
}

}  // namespace vramd::dist
