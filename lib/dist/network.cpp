#include "dist/network.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::dist {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kNoAnswer = "no answer";

struct AddressList {
  addrinfo* first = nullptr;
  ~AddressList() {
    if (first) freeaddrinfo(first);
  }
};

// host:port's addresses for sockets of `type`; throws Error naming `host` when it does not resolve.
void resolve(const std::string& host, uint16_t port, int type, AddressList& list) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = type;
  const int status = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list.first);
  if (status != 0)
    throw Error(quote(host) + " does not resolve to an address: " +
                (status == EAI_SYSTEM ? std::strerror(errno) : gai_strerror(status)));
}

std::string text_of(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* bytes = address->sa_family == AF_INET6
                          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr)
                          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(address)->sin_addr);
  inet_ntop(address->sa_family, bytes, text, sizeof text);
  return text;
}

// "::ffff:10.0.0.1", an IPv4 peer of an IPv6 socket (as c10d's store clients connect), as "10.0.0.1".
std::string unmapped(const std::string& address) {
  constexpr std::string_view mapped = "::ffff:";
  const bool v4 = address.starts_with(mapped) && address.find('.') != std::string::npos;
  return v4 ? address.substr(mapped.size()) : address;
}

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// One connection attempt that gives up at `deadline`; empty when it connected, else why not.
std::string try_connect(const addrinfo& address, Clock::time_point deadline) {
  Socket socket(::socket(address.ai_family, address.ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, address.ai_protocol));
  if (socket.get() < 0) return std::strerror(errno);
  if (connect(socket.get(), address.ai_addr, address.ai_addrlen) == 0) return {};
  if (errno != EINPROGRESS) return std::strerror(errno);
  pollfd wanted{socket.get(), POLLOUT, 0};
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  const int ready = poll(&wanted, 1, static_cast<int>(std::max<int64_t>(left, 0)));
  if (ready == 0) return kNoAnswer;
  if (ready < 0) return std::strerror(errno);
  int error = 0;
  socklen_t length = sizeof error;
  getsockopt(socket.get(), SOL_SOCKET, SO_ERROR, &error, &length);
  return error == 0 ? std::string() : std::strerror(error);
}

// A socket bound to `port` on every address of `family` (IPv4 too, for IPv6); -1 and errno when not.
int bound_socket(int family, uint16_t port) {
  Socket socket(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (socket.get() < 0) return -1;
  const int on = 1, off = 0;
  setsockopt(socket.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_storage any{};
  socklen_t length = sizeof(sockaddr_in);
  if (family == AF_INET6) {
    setsockopt(socket.get(), IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
    auto& v6 = reinterpret_cast<sockaddr_in6&>(any);
    v6.sin6_family = AF_INET6;
    v6.sin6_addr = in6addr_any;
    v6.sin6_port = htons(port);
    length = sizeof v6;
  } else {
    auto& v4 = reinterpret_cast<sockaddr_in&>(any);
    v4.sin_family = AF_INET;
    v4.sin_addr.s_addr = htonl(INADDR_ANY);
    v4.sin_port = htons(port);
  }
  if (bind(socket.get(), reinterpret_cast<sockaddr*>(&any), length) != 0) return -1;
  return socket.release();
}

// One connection to each of a host's addresses in turn; empty when one worked, else the most
// telling failure: an attempt the deadline cut short says less than one refused before it.
std::string connect_once(const AddressList& list, Clock::time_point deadline, std::string failure) {
  for (const addrinfo* each = list.first; each; each = each->ai_next) {
    const std::string why = try_connect(*each, deadline);
    if (why.empty()) return {};
    if (why != kNoAnswer || failure == kNoAnswer) failure = why;
  }
  return failure;
}

}  // namespace

std::string address_toward(const std::string& host, uint16_t port) {
  AddressList list;
  resolve(host, port, SOCK_DGRAM, list);
  std::string failure;
  for (const addrinfo* each = list.first; each; each = each->ai_next) {
    Socket socket(::socket(each->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    if (socket.get() >= 0 && connect(socket.get(), each->ai_addr, each->ai_addrlen) == 0 &&
        getsockname(socket.get(), reinterpret_cast<sockaddr*>(&local), &length) == 0)
      return text_of(reinterpret_cast<const sockaddr*>(&local));
    failure = text_of(each->ai_addr) + ": " + std::strerror(errno);
  }
  throw Error("no route from this host to " + quote(host) + " (" + failure + ")");
}

std::string interface_address(const std::string& name) {
  ifaddrs* first = nullptr;
  if (getifaddrs(&first) != 0)
    throw Error(std::string("cannot list this host's network interfaces: ") + std::strerror(errno));
  const std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> owner(first, freeifaddrs);
  std::vector<std::string> names;
  std::string v4, v6;
  for (const ifaddrs* each = first; each; each = each->ifa_next) {
    if (std::find(names.begin(), names.end(), each->ifa_name) == names.end()) names.emplace_back(each->ifa_name);
    if (name != each->ifa_name || !each->ifa_addr) continue;
    const int family = each->ifa_addr->sa_family;
    if (family == AF_INET && v4.empty()) v4 = text_of(each->ifa_addr);
    // A link-local IPv6 address needs a scope that other hosts' addresses of it do not carry.
    if (family == AF_INET6 && v6.empty() &&
        !IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(each->ifa_addr)->sin6_addr))
      v6 = text_of(each->ifa_addr);
  }
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  if (std::find(names.begin(), names.end(), name) != names.end())
    throw Error("network interface " + quote(name) + " has no address");
  std::string list;
  for (const auto& each : names) list += (list.empty() ? "" : ", ") + each;
  throw Error("no network interface " + quote(name) + " on this host (it has " + list + ")");
}

bool is_loopback_address(const std::string& address) {
  in_addr v4{};
  if (inet_pton(AF_INET, address.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, address.c_str(), &v6) != 1) return false;
  return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
}

std::string try_reach(const std::string& host, uint16_t port, Clock::time_point deadline) {
  AddressList list;
  resolve(host, port, SOCK_STREAM, list);
  return connect_once(list, deadline, kNoAnswer);
}

void wait_until_reachable(const std::string& host, uint16_t port, Clock::time_point deadline) {
  AddressList list;
  resolve(host, port, SOCK_STREAM, list);
  std::string failure = kNoAnswer;
  do {
    failure = connect_once(list, deadline, failure);
    if (failure.empty()) return;
    // A refusal comes back at once: the store may not be up yet.
    std::this_thread::sleep_until(std::min(deadline, Clock::now() + std::chrono::milliseconds(100)));
  } while (Clock::now() < deadline);
  throw Error(failure);
}

std::vector<int> connections_to(const std::string& host, uint16_t port) {
  AddressList list;
  resolve(host, port, SOCK_STREAM, list);
  std::vector<std::string> addresses;
  for (const addrinfo* each = list.first; each; each = each->ai_next) addresses.push_back(text_of(each->ai_addr));
  std::vector<int> found;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", error)) {
    const int fd = std::atoi(entry.path().filename().c_str());
    sockaddr_storage peer{};
    socklen_t length = sizeof peer;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) continue;  // not a connected socket
    const auto* address = reinterpret_cast<const sockaddr*>(&peer);
    if (address->sa_family != AF_INET && address->sa_family != AF_INET6) continue;
    const uint16_t peer_port =
        ntohs(address->sa_family == AF_INET ? reinterpret_cast<const sockaddr_in*>(address)->sin_port
                                            : reinterpret_cast<const sockaddr_in6*>(address)->sin6_port);
    if (peer_port == port &&
        std::find(addresses.begin(), addresses.end(), unmapped(text_of(address))) != addresses.end())
      found.push_back(fd);
  }
  return found;
}

void bound_connection(int fd, std::chrono::milliseconds timeout) {
  const int on = 1;
  const int probe_every =
      static_cast<int>(std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::seconds>(timeout).count() / 4));
  const unsigned unanswered = static_cast<unsigned>(timeout.count());
  // Failures leave the connection as it was: an fd that is no longer a socket is no store's.
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &probe_every, sizeof probe_every);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &probe_every, sizeof probe_every);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &unanswered, sizeof unanswered);
}

int listen_on_port(uint16_t port) {
  int fd = bound_socket(AF_INET6, port);
  if (fd < 0 && errno == EAFNOSUPPORT) fd = bound_socket(AF_INET, port);  // IPv6 is off on this host
  if (fd < 0 || listen(fd, SOMAXCONN) != 0) {
    const int error = errno;
    if (fd >= 0) close(fd);
    throw Error("cannot listen on port " + std::to_string(port) + ": " + std::strerror(error));
  }
  return fd;
}

}  // namespace vramd::dist
