// What a group's ranks need of the network around c10d (dist/group.hpp): the local address that
// reaches rank 0, an interface's address, the store reached within a deadline rather than by
// c10d's own retries, which run past it, and its connections closed by the kernel when the
// store's host goes away, which c10d's client would wait on without end. LibTorch-free.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace vramd::dist {

// The address this host's packets to host:port leave from, as the kernel's routes choose it (a
// UDP socket connected there tells it; no packet is sent). A loopback address only when `host`
// is one. Throws Error naming `host` when it does not resolve or no route leads there.
std::string address_toward(const std::string& host, uint16_t port);

// The interface's first IPv4 address, else its first IPv6 one. Throws Error naming it, with the
// interfaces this host has, when there is no such interface or it has no address.
std::string interface_address(const std::string& name);

bool is_loopback_address(const std::string& address);

// Connects to host:port once (and closes): empty when it worked, else why not ("Connection
// refused", "No route to host", "no answer" by `deadline`). Throws Error when `host` does not resolve.
std::string try_reach(const std::string& host, uint16_t port, std::chrono::steady_clock::time_point deadline);

// The same again and again until it works or `deadline` passes; then throws Error with the last
// failure.
void wait_until_reachable(const std::string& host, uint16_t port, std::chrono::steady_clock::time_point deadline);

// This process's TCP connections to host:port (those of c10d's store clients, whose sockets it
// does not expose), as file descriptors.
std::vector<int> connections_to(const std::string& host, uint16_t port);

// Has the kernel close the connection `fd` when what it sent goes unacknowledged for `timeout`,
// and probe the peer when it is idle so that a peer whose host went away is noticed as well.
void bound_connection(int fd, std::chrono::milliseconds timeout);

// A socket listening on `port` on every address (IPv6 and IPv4, or IPv4 where IPv6 is off): rank
// 0's store, handed to c10d, which serves on it. Throws Error naming the port.
int listen_on_port(uint16_t port);

}  // namespace vramd::dist
