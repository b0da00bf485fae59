// What a group's ranks ask of the network before c10d (dist/network.hpp), on this host's
// loopback. tests/parity/test_partition_hosts.py runs the same across two network namespaces.
#include "dist/network.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>

#include "support/free_port.hpp"

using namespace vramd::dist;
using Clock = std::chrono::steady_clock;
using vramd::test::free_port;

namespace {

// As c10d's store clients connect: an IPv6 socket to the IPv4-mapped address.
int connect_to(uint16_t port) {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 address{};
  address.sin6_family = AF_INET6;
  address.sin6_addr.s6_addr[10] = address.sin6_addr.s6_addr[11] = 0xff;
  address.sin6_addr.s6_addr[12] = 127;
  address.sin6_addr.s6_addr[15] = 1;
  address.sin6_port = htons(port);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  return fd;
}

}  // namespace

TEST_CASE("a group's address towards a loopback master is loopback and only then") {
  CHECK(address_toward("127.0.0.1", 29500) == "127.0.0.1");
  CHECK(is_loopback_address("127.0.1.1"));  // Debian's address for the host's own name
  CHECK(is_loopback_address("::1"));
  CHECK(is_loopback_address("::ffff:127.0.0.1"));
  CHECK_FALSE(is_loopback_address("10.0.0.1"));
  CHECK_FALSE(is_loopback_address("fe80::1"));
  CHECK_FALSE(is_loopback_address("node0"));
}

TEST_CASE("a group's interface gives its IPv4 address and an unknown one is named with the host's") {
  CHECK(interface_address("lo") == "127.0.0.1");
  CHECK_THROWS_WITH(
      interface_address("no-such-if0"),
      Catch::StartsWith("no network interface 'no-such-if0' on this host (it has ") && Catch::Contains("lo"));
}

TEST_CASE("a group's store is waited for until the deadline and then the failure is named") {
  const uint16_t port = free_port();
  CHECK(try_reach("127.0.0.1", port, Clock::now() + std::chrono::seconds(1)) == "Connection refused");
  const auto start = Clock::now();
  CHECK_THROWS_WITH(wait_until_reachable("127.0.0.1", port, start + std::chrono::milliseconds(300)),
                    "Connection refused");
  CHECK(Clock::now() - start >= std::chrono::milliseconds(300));
  CHECK(Clock::now() - start < std::chrono::milliseconds(1000));

  const int listener = listen_on_port(port);
  CHECK_THROWS_WITH(listen_on_port(port), "cannot listen on port " + std::to_string(port) + ": Address already in use");
  wait_until_reachable("127.0.0.1", port, Clock::now() + std::chrono::seconds(1));
  CHECK(try_reach("127.0.0.1", port, Clock::now() + std::chrono::seconds(1)).empty());
  ::close(listener);
}

TEST_CASE("a group's store connection is found and bounded by the kernel") {
  const uint16_t port = free_port();
  const int listener = listen_on_port(port);
  CHECK(connections_to("127.0.0.1", port).empty());
  const int client = connect_to(port);
  CHECK(connections_to("127.0.0.1", port) == std::vector<int>{client});
  bound_connection(client, std::chrono::seconds(8));
  int value = 0;
  socklen_t size = sizeof value;
  REQUIRE(::getsockopt(client, IPPROTO_TCP, TCP_USER_TIMEOUT, &value, &size) == 0);
  CHECK(value == 8000);
  REQUIRE(::getsockopt(client, SOL_SOCKET, SO_KEEPALIVE, &value, &size) == 0);
  CHECK(value == 1);
  REQUIRE(::getsockopt(client, IPPROTO_TCP, TCP_KEEPIDLE, &value, &size) == 0);
  CHECK(value == 2);
  ::close(client);
  ::close(listener);
}
