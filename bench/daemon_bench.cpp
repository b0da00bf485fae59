// The daemon's request path, measured from the client side (bench/daemon.py drives it):
//
//   vramd_bench_daemon status SOCKET CLIENTS REQUESTS  latency of GET /v1/status, CLIENTS at once
//   vramd_bench_daemon forward SOCKET MODEL INPUT N    N forwards; transport time = wall - the
//                                                      daemon's own forward time for them
//   vramd_bench_daemon copy BYTES                      a raw Unix-socket copy of BYTES: the bound
//   vramd_bench_daemon serve SOCKET BODY               a bare libuv responder: every request on
//                                                      SOCKET answered with the file BODY as JSON,
//                                                      keep-alive, until SIGTERM (the bound for status)
//
// Each prints one JSON object.
#include <csignal>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

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

// The least a libuv server answering every request with the same body does: a read buffer per
// connection, the end of each request's head found, one write of head and body for it.
struct Bare {
  uv_pipe_t pipe;
  std::string request;  // bytes read not yet answered
  static inline std::string response;
};

void on_close(uv_handle_t* handle) { delete reinterpret_cast<Bare*>(handle); }

void on_read(uv_stream_t* stream, ssize_t n, const uv_buf_t* buf) {
  auto* bare = reinterpret_cast<Bare*>(stream);
  if (n < 0) {
    delete[] buf->base;
    uv_close(reinterpret_cast<uv_handle_t*>(stream), on_close);
    return;
  }
  bare->request.append(buf->base, static_cast<size_t>(n));
  delete[] buf->base;
  size_t end;
  while ((end = bare->request.find("\r\n\r\n")) != std::string::npos) {
    bare->request.erase(0, end + 4);
    auto* write = new uv_write_t;
    uv_buf_t out = uv_buf_init(Bare::response.data(), static_cast<unsigned>(Bare::response.size()));
    uv_write(write, stream, &out, 1, [](uv_write_t* w, int) { delete w; });
  }
}

int serve(const std::string& socket, const std::string& body_path) {
  const std::string body = vramd::read_regular_file(body_path, uint64_t{1} << 30);
  Bare::response = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                   "\r\n\r\n" + body;
  uv_loop_t* loop = uv_default_loop();
  uv_pipe_t server;
  uv_pipe_init(loop, &server, 0);
  ::unlink(socket.c_str());
  if (uv_pipe_bind(&server, socket.c_str()) != 0) return 1;
  const int listening = uv_listen(reinterpret_cast<uv_stream_t*>(&server), 1024, [](uv_stream_t* listener, int status) {
    if (status != 0) return;
    auto* bare = new Bare;
    uv_pipe_init(listener->loop, &bare->pipe, 0);
    if (uv_accept(listener, reinterpret_cast<uv_stream_t*>(&bare->pipe)) != 0) {
      uv_close(reinterpret_cast<uv_handle_t*>(&bare->pipe), on_close);
      return;
    }
    uv_read_start(
        reinterpret_cast<uv_stream_t*>(&bare->pipe),
        [](uv_handle_t*, size_t size, uv_buf_t* buf) { *buf = uv_buf_init(new char[size], static_cast<unsigned>(size)); },
        on_read);
  });
  if (listening != 0) return 1;
  uv_signal_t stop;
  uv_signal_init(loop, &stop);
  uv_signal_start(&stop, [](uv_signal_t* s, int) { uv_stop(s->loop); }, SIGTERM);
  std::cout << json{{"serving", socket}, {"bytes", body.size()}}.dump() << std::endl;
  uv_run(loop, UV_RUN_DEFAULT);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 4 && args[0] == "status") return status(args[1], std::stoi(args[2]), std::stoi(args[3]));
    if (args.size() == 5 && args[0] == "forward") return forward(args[1], args[2], args[3], std::stoi(args[4]));
    if (args.size() == 2 && args[0] == "copy") return copy(std::stoull(args[1]));
    if (args.size() == 3 && args[0] == "serve") return serve(args[1], args[2]);
  } catch (const std::exception& e) {
    std::cerr << "vramd_bench_daemon: " << e.what() << '\n';
    return 1;
  }
  std::cerr << "usage: vramd_bench_daemon status SOCKET CLIENTS REQUESTS | forward SOCKET MODEL INPUT N | copy BYTES | serve SOCKET BODY\n";
  return 2;
}
