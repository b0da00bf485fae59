#include "client/client.hpp"

#include <http_parser.h>
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

void Client::connect() {
  fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path_.size() >= sizeof address.sun_path) fail(path_, "socket path too long");
  std::strncpy(address.sun_path, path_.c_str(), sizeof address.sun_path - 1);
  if (::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd_);
    fd_ = -1;
    throw Error("cannot reach vramd at " + path_ + ": " + why +
                "; is the daemon running? (start it with scripts/run, or pass --socket / set VRAMD_SOCKET)");
  }
  // Whoever listens on the path answers: send nothing to a server run by an untrusted user.
  ucred server{};
  socklen_t length = sizeof server;
  if (::getsockopt(fd_, SOL_SOCKET, SO_PEERCRED, &server, &length) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd_);
    fd_ = -1;
    fail(path_, "cannot tell who serves this socket (SO_PEERCRED: " + why + "); refused");
  }
  const auto trusted = trusted_server_uids();
  if (std::find(trusted.begin(), trusted.end(), server.uid) == trusted.end()) {
    ::close(fd_);
    fd_ = -1;
    fail(path_, "served by uid " + std::to_string(server.uid) + " (pid " + std::to_string(server.pid) +
                    "), which is neither you (uid " + std::to_string(::getuid()) +
                    ") nor root; refused. If that user runs your vramd, set VRAMD_TRUST_UIDS=" + std::to_string(server.uid));
  }
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
                         const std::function<void(std::string_view)>& on_chunk) {
  for (int attempt = 0;; ++attempt) {
    const bool reused = fd_ >= 0;
    if (!reused) connect();
    std::string head = std::string(method) + " " + std::string(target) + " HTTP/1.1\r\nHost: vramd\r\n";
    head += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
    bool sent = true;
    try {
      send_all(fd_, head);
      send_all(fd_, body);
    } catch (const Error&) {
      sent = false;
    }
    Parse parse{{}, &on_chunk, {}, false, false};
    http_parser parser;
    http_parser_init(&parser, HTTP_RESPONSE);
    parser.data = &parse;
    http_parser_settings settings{};
    settings.on_header_field = on_header_field;
    settings.on_header_value = on_header_value;
    settings.on_body = on_body;
    settings.on_message_complete = on_message_complete;
    char buffer[64 << 10];
    size_t received = 0;
    while (sent && !parse.complete) {
      const ssize_t n = ::recv(fd_, buffer, sizeof buffer, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) break;
      received += static_cast<size_t>(n);
      http_parser_execute(&parser, &settings, buffer, static_cast<size_t>(n));
      if (n == 0) break;
      const auto error = HTTP_PARSER_ERRNO(&parser);
      if (error != HPE_OK && error != HPE_PAUSED)
        throw Error("vramd at " + path_ + " sent a malformed answer: " + http_errno_description(error));
    }
    if (parse.complete) {
      parse.response.status = static_cast<int>(parser.status_code);
      if (!http_should_keep_alive(&parser)) {
        ::close(fd_);
        fd_ = -1;
      }
      return parse.response;
    }
    ::close(fd_);
    fd_ = -1;
    // A reused connection the daemon had closed (idle timeout): try once more on a new one.
    if (reused && received == 0 && attempt == 0) continue;
    throw Error("vramd at " + path_ + " closed the connection before answering");
  }
}

}  // namespace vramd::client
