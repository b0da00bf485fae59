// A blocking HTTP/1.1 client for vramd's Unix socket (vramctl, tests, benchmarks), with
// responses parsed by http-parser. One connection, reused across requests.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "util/cuda_vmm.hpp"
#include "util/unique_fd.hpp"

namespace vramd::client {

struct Response {
  int status = 0;
  std::string content_type;
  std::string body;  // empty when streamed to on_chunk
};

// A model's weights held from the daemon (docs/api.md, "Leases"): the manifest and one descriptor
// per region, in the manifest's order. The lease lasts as long as this object (its connection).
struct Lease {
  std::string manifest;  // JSON: model, lease, device, bytes, regions, tensors
  std::vector<UniqueFd> regions;
  UniqueFd connection;
};

class Client {
 public:
  explicit Client(std::string socket_path);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Throws Error when the daemon cannot be reached, when the socket is served by a user who is
  // neither the caller, root, nor listed in $VRAMD_TRUST_UIDS (checked with SO_PEERCRED before a
  // byte is sent), or when the answer is not HTTP. `on_chunk`, when
  // given, receives the body as it arrives instead of collecting it.
  Response request(std::string_view method, std::string_view target, std::string_view body = {},
                   const std::function<void(std::string_view)>& on_chunk = {}, std::string_view content_type = {});

  // Takes a lease of `model` on `device` on a connection of its own. Throws Error with the
  // daemon's message (and HTTP status) when it refuses.
  Lease lease(const std::string& model, const std::string& device = "cpu");

  const std::string& socket_path() const { return path_; }

 private:
  int open_connection() const;
  void connect();
  std::string path_;
  int fd_ = -1;
};

// The regions of a lease of GPU memory (its manifest's "device" is "cuda:N"), each imported and
// mapped into this process read-only where the driver allows (util/cuda_vmm.hpp): tensor t's
// bytes start at regions[t.region]->data() + t.offset. Throws Error for a lease of host memory,
// or naming the region the driver refuses.
std::vector<std::shared_ptr<cuda::VmmRegion>> map_cuda_regions(const Lease& lease);

// The daemon's own words for a refusal (its {"error": "..."}), else the status and the body's start.
std::string error_text(const Response& response);

// --socket when given, else $VRAMD_SOCKET, else the daemon config's socket.
std::string socket_path(const std::string& flag, const std::string& daemon_config);

}  // namespace vramd::client
