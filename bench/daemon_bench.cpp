// The daemon's request path, measured from the client side (bench/daemon.py drives it):
//
//   vramd_bench_daemon status SOCKET CLIENTS REQUESTS  latency of GET /v1/status, CLIENTS at once
//   vramd_bench_daemon forward SOCKET MODEL INPUT N    N forwards; transport time = wall - the
//                                                      daemon's own forward time for them
//   vramd_bench_daemon copy BYTES                      a raw Unix-socket copy of BYTES: the bound
//
// Each prints one JSON object.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/client.hpp"
#include "util/file.hpp"

using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

int status(const std::string& socket, int clients, int requests) {
  std::vector<std::vector<double>> latencies(clients);
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      vramd::client::Client client(socket);  // one keep-alive connection per client
      for (int i = 0; i < requests; ++i) {
        const auto t = Clock::now();
        if (client.request("GET", "/v1/status").status != 200) std::abort();
        latencies[c].push_back(since(t));
      }
    });
  for (auto& t : threads) t.join();
  const double wall = since(start);
  std::vector<double> all;
  for (auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  const auto at = [&](double q) { return all[std::min(all.size() - 1, static_cast<size_t>(q * all.size()))] * 1e3; };
  std::cout << json{{"clients", clients}, {"requests", all.size()}, {"p50_ms", at(0.5)}, {"p99_ms", at(0.99)},
                    {"max_ms", all.back() * 1e3}, {"requests_per_second", all.size() / wall}}.dump() << '\n';
  return 0;
}

double forward_seconds(vramd::client::Client& client, const std::string& model) {
  return json::parse(client.request("GET", "/v1/models/" + model).body)["stats"]["forward_seconds"].get<double>();
}

int forward(const std::string& socket, const std::string& model, const std::string& input_path, int n) {
  const std::string input = vramd::read_regular_file(input_path, uint64_t{1} << 30);
  vramd::client::Client client(socket);
  client.request("POST", "/v1/models/" + model + "/forward", input);  // loads, warms up
  const double compute_before = forward_seconds(client, model);
  size_t output_bytes = 0;
  const auto start = Clock::now();
  for (int i = 0; i < n; ++i) {
    const auto response = client.request("POST", "/v1/models/" + model + "/forward", input);
    if (response.status != 200) std::abort();
    output_bytes = response.body.size();
  }
  const double wall = since(start);
  const double compute = forward_seconds(client, model) - compute_before;
  const double moved = static_cast<double>(n) * static_cast<double>(input.size() + output_bytes);
  std::cout << json{{"forwards", n}, {"request_bytes", input.size()}, {"response_bytes", output_bytes},
                    {"wall_seconds", wall}, {"compute_seconds", compute}, {"transport_seconds", wall - compute},
                    {"transport_gb_per_s", moved / (wall - compute) / 1e9}}.dump() << '\n';
  return 0;
}

int copy(size_t bytes) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return 1;
  std::string data(bytes, 'x');
  const auto start = Clock::now();
  std::thread writer([&] {
    for (size_t sent = 0; sent < bytes;) {
      const ssize_t n = ::write(fds[0], data.data() + sent, std::min<size_t>(bytes - sent, 1 << 20));
      if (n <= 0) std::abort();
      sent += static_cast<size_t>(n);
    }
  });
  std::string received(bytes, '\0');  // into fresh memory, as the client does
  for (size_t got = 0; got < bytes;) {
    const ssize_t n = ::read(fds[1], received.data() + got, std::min<size_t>(bytes - got, 64 << 10));
    if (n <= 0) std::abort();
    got += static_cast<size_t>(n);
  }
  writer.join();
  const double wall = since(start);
  std::cout << json{{"bytes", bytes}, {"seconds", wall}, {"gb_per_s", bytes / wall / 1e9}}.dump() << '\n';
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 4 && args[0] == "status") return status(args[1], std::stoi(args[2]), std::stoi(args[3]));
    if (args.size() == 5 && args[0] == "forward") return forward(args[1], args[2], args[3], std::stoi(args[4]));
    if (args.size() == 2 && args[0] == "copy") return copy(std::stoull(args[1]));
  } catch (const std::exception& e) {
    std::cerr << "vramd_bench_daemon: " << e.what() << '\n';
    return 1;
  }
  std::cerr << "usage: vramd_bench_daemon status SOCKET CLIENTS REQUESTS | forward SOCKET MODEL INPUT N | copy BYTES\n";
  return 2;
}
