#include "client/client.hpp"

#include <http_parser.h>
#include <nlohmann/json.hpp>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "config/daemon_config.hpp"
#include "util/error.hpp"
#include "util/utf8.hpp"

namespace vramd::client {

std::string socket_path(const std::string& flag, const std::string& daemon_config) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("VRAMD_SOCKET"); env && *env) return env;
  return config::find_daemon_config(daemon_config).socket;
}

Client::Client(std::string socket_path) : path_(std::move(socket_path)) {}

Client::~Client() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// The daemon's user may be the client's own, root, or one listed in $VRAMD_TRUST_UIDS.
std::vector<uid_t> trusted_server_uids() {
  std::vector<uid_t> uids = {::getuid(), 0};
  const char* listed = std::getenv("VRAMD_TRUST_UIDS");
  for (std::string_view rest = listed ? listed : ""; !rest.empty();) {
    const auto comma = rest.find(',');
    const std::string item(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    char* end = nullptr;
    const unsigned long uid = std::strtoul(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || uid > UINT32_MAX)
      throw Error("VRAMD_TRUST_UIDS=" + std::string(listed) + ": expected numeric uids separated by commas");
    uids.push_back(static_cast<uid_t>(uid));
  }
  return uids;
}

}  // namespace

void Client::connect() { fd_ = open_connection(); }

int Client::open_connection() const {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path_.size() >= sizeof address.sun_path) fail(path_, "socket path too long");
  std::strncpy(address.sun_path, path_.c_str(), sizeof address.sun_path - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw Error("cannot reach vramd at " + path_ + ": " + why +
                "; is the daemon running? (start it with scripts/run, or pass --socket / set VRAMD_SOCKET)");
  }
  // Whoever listens on the path answers: send nothing to a server run by an untrusted user.
  ucred server{};
  socklen_t length = sizeof server;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &server, &length) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    fail(path_, "cannot tell who serves this socket (SO_PEERCRED: " + why + "); refused");
  }
  const auto trusted = trusted_server_uids();
  if (std::find(trusted.begin(), trusted.end(), server.uid) == trusted.end()) {
    ::close(fd);
    fail(path_, "served by uid " + std::to_string(server.uid) + " (pid " + std::to_string(server.pid) +
                    "), which is neither you (uid " + std::to_string(::getuid()) +
                    ") nor root; refused. If that user runs your vramd, set VRAMD_TRUST_UIDS=" + std::to_string(server.uid));
  }
  return fd;
}

namespace {

struct Parse {
  Response response;
  const std::function<void(std::string_view)>* on_chunk;
  std::string field;
  bool in_content_type = false;
  bool complete = false;
};

int on_header_field(http_parser* p, const char* at, size_t n) {
  auto* s = static_cast<Parse*>(p->data);
  std::string name(at, n);
  for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  s->in_content_type = name == "content-type";
  return 0;
}
int on_header_value(http_parser* p, const char* at, size_t n) {
  auto* s = static_cast<Parse*>(p->data);
  if (s->in_content_type) s->response.content_type.append(at, n);
  return 0;
}
int on_body(http_parser* p, const char* at, size_t n) {
  auto* s = static_cast<Parse*>(p->data);
  if (*s->on_chunk) (*s->on_chunk)({at, n});
  else s->response.body.append(at, n);
  return 0;
}
int on_message_complete(http_parser* p) {
  static_cast<Parse*>(p->data)->complete = true;
  http_parser_pause(p, 1);
  return 0;
}

// One response, parsed as its bytes arrive.
class ResponseReader {
 public:
  explicit ResponseReader(const std::function<void(std::string_view)>& on_chunk) : parse_{{}, &on_chunk, {}, false, false} {
    http_parser_init(&parser_, HTTP_RESPONSE);
    parser_.data = &parse_;
    settings_.on_header_field = on_header_field;
    settings_.on_header_value = on_header_value;
    settings_.on_body = on_body;
    settings_.on_message_complete = on_message_complete;
  }
  ResponseReader(const ResponseReader&) = delete;
  ResponseReader& operator=(const ResponseReader&) = delete;

  // Feeds `n` bytes (0: the connection ended); true once the response is complete. Throws Error
  // naming `where` when the bytes are not HTTP.
  bool feed(const char* data, size_t n, const std::string& where) {
    http_parser_execute(&parser_, &settings_, data, n);
    const auto error = HTTP_PARSER_ERRNO(&parser_);
    if (error != HPE_OK && error != HPE_PAUSED)
      throw Error("vramd at " + where + " sent a malformed answer: " + http_errno_description(error));
    return parse_.complete;
  }
  bool keep_alive() const { return http_should_keep_alive(&parser_); }
  Response take() {
    parse_.response.status = static_cast<int>(parser_.status_code);
    return std::move(parse_.response);
  }

 private:
  Parse parse_;
  http_parser parser_;
  http_parser_settings settings_{};
};

void send_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error(std::string("sending to vramd failed: ") + std::strerror(errno));
    data.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace

Response Client::request(std::string_view method, std::string_view target, std::string_view body,
                         const std::function<void(std::string_view)>& on_chunk, std::string_view content_type) {
  for (int attempt = 0;; ++attempt) {
    const bool reused = fd_ >= 0;
    if (!reused) connect();
    std::string head = std::string(method) + " " + std::string(target) + " HTTP/1.1\r\nHost: vramd\r\n";
    if (!content_type.empty()) head += "Content-Type: " + std::string(content_type) + "\r\n";
    head += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
    bool sent = true;
    try {
      send_all(fd_, head);
      send_all(fd_, body);
    } catch (const Error&) {
      sent = false;
    }
    ResponseReader reader(on_chunk);
    bool complete = false;
    char buffer[64 << 10];
    size_t received = 0;
    while (sent && !complete) {
      const ssize_t n = ::recv(fd_, buffer, sizeof buffer, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) break;
      received += static_cast<size_t>(n);
      complete = reader.feed(buffer, static_cast<size_t>(n), path_);
      if (n == 0) break;
    }
    if (complete) {
      if (!reader.keep_alive()) {
        ::close(fd_);
        fd_ = -1;
      }
      return reader.take();
    }
    ::close(fd_);
    fd_ = -1;
    // A reused connection the daemon had closed (idle timeout): try once more on a new one.
    if (reused && received == 0 && attempt == 0) continue;
    throw Error("vramd at " + path_ + " closed the connection before answering");
  }
}

Lease Client::lease(const std::string& model, const std::string& device) {
  Lease lease;
  lease.connection = UniqueFd(open_connection());
  const int fd = lease.connection.get();
  const std::string body = nlohmann::json{{"device", device}}.dump();
  send_all(fd, "POST /v1/models/" + model + "/lease HTTP/1.1\r\nHost: vramd\r\nContent-Type: application/json\r\n"
               "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  // Descriptors ride on the bytes they were sent with, and a plain recv() would drop them:
  // every read is a recvmsg() that keeps them.
  std::string received;
  size_t head_end = std::string::npos;
  for (;;) {
    char buffer[64 << 10];
    alignas(cmsghdr) char control[CMSG_SPACE(253 * sizeof(int))];
    iovec data{buffer, sizeof buffer};
    msghdr message{};
    message.msg_iov = &data;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(fd, &message, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error("reading the lease of " + model + " from vramd failed: " + std::strerror(errno));
    for (cmsghdr* c = CMSG_FIRSTHDR(&message); c; c = CMSG_NXTHDR(&message, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
        for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
          int received_fd;
          std::memcpy(&received_fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          lease.regions.emplace_back(received_fd);
        }
    if (message.msg_flags & MSG_CTRUNC) throw Error("the lease of " + model + " carried more descriptors than expected");
    if (n == 0) throw Error("vramd closed the connection before handing over the lease of " + model);
    received.append(buffer, static_cast<size_t>(n));
    if (head_end == std::string::npos && (head_end = received.find("\r\n\r\n")) == std::string::npos) continue;
    if (!received.starts_with("HTTP/1.1 101")) break;  // a refusal: an HTTP answer like any other
    const auto newline = received.find('\n', head_end + 4);
    if (newline == std::string::npos) continue;
    lease.manifest = received.substr(head_end + 4, newline - head_end - 4);
    return lease;
  }
  const std::function<void(std::string_view)> whole;
  ResponseReader reader(whole);
  for (bool complete = reader.feed(received.data(), received.size(), path_); !complete;) {
    char buffer[64 << 10];
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error("vramd closed the connection before answering the lease of " + model);
    complete = reader.feed(buffer, static_cast<size_t>(n), path_);
  }
  const Response refusal = reader.take();
  throw Error("lease of " + model + " refused (HTTP " + std::to_string(refusal.status) + "): " + error_text(refusal));
}

std::vector<std::shared_ptr<cuda::VmmRegion>> map_cuda_regions(const Lease& lease) {
  const auto manifest = nlohmann::json::parse(lease.manifest);
  const std::string device = manifest.at("device").get<std::string>();
  if (!device.starts_with("cuda:")) throw Error("a lease on " + device + " holds no CUDA memory");
  const int ordinal = std::stoi(device.substr(5));
  const auto& regions = manifest.at("regions");
  if (regions.size() != lease.regions.size())
    throw Error("vramd sent " + std::to_string(lease.regions.size()) + " descriptors for " +
                std::to_string(regions.size()) + " regions");
  std::vector<std::shared_ptr<cuda::VmmRegion>> mapped;
  for (size_t i = 0; i < regions.size(); ++i) {
    try {
      mapped.push_back(cuda::VmmRegion::import(ordinal, lease.regions[i].get(), regions[i].at("size").get<uint64_t>(), true));
    } catch (const Error& e) {
      throw Error("region " + std::to_string(i) + " of the lease: " + e.what());
    }
  }
  return mapped;
}

// One printable line: the daemon quotes files and requests in its errors, and whatever answers
// on the socket may not be vramd.
std::string error_text(const Response& response) {
  const auto body = nlohmann::json::parse(response.body, nullptr, false);
  std::string text = body.is_object() && body.contains("error") && body["error"].is_string()
                         ? body["error"].get<std::string>()
                         : "HTTP " + std::to_string(response.status) + ": " + response.body.substr(0, 200);
  std::replace(text.begin(), text.end(), '\n', ' ');
  return printable(text);
}

}  // namespace vramd::client
