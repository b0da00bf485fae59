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

Lease Client::lease(const std::string& model, const std::string& device) {
  Lease lease;
  lease.connection = UniqueFd(open_connection());
  const int fd = lease.connection.get();
  const std::string body = "{\"device\": \"" + device + "\"}";
  send_all(fd, "POST /v1/models/" + model + "/lease HTTP/1.1\r\nHost: vramd\r\nContent-Type: application/json\r\n"
               "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  // Descriptors ride on the bytes they were sent with, and a plain recv() would drop them:
  // every read is a recvmsg() that keeps them.
  std::string received;
  size_t head_end = std::string::npos;
  uint64_t content_length = 0;
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
    if (head_end == std::string::npos) {
      head_end = received.find("\r\n\r\n");
      if (head_end == std::string::npos) continue;
      head_end += 4;
      if (!received.starts_with("HTTP/1.1 101")) {
        std::string lower = received.substr(0, head_end);
        for (auto& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        const auto at = lower.find("content-length:");
        content_length = at == std::string::npos ? 0 : std::strtoull(lower.c_str() + at + 15, nullptr, 10);
      }
    }
    if (received.starts_with("HTTP/1.1 101")) {
      const auto newline = received.find('\n', head_end);
      if (newline == std::string::npos) continue;
      lease.manifest = received.substr(head_end, newline - head_end);
      return lease;
    }
    if (received.size() - head_end < content_length) continue;
    const std::string status = received.substr(9, 3), answer = received.substr(head_end, content_length);
    const auto error = nlohmann::json::parse(answer, nullptr, false);
    const bool documented = error.is_object() && error.contains("error") && error["error"].is_string();
    throw Error("lease of " + model + " refused (HTTP " + status + "): " +
                (documented ? error["error"].get<std::string>() : answer.substr(0, 200)));
  }
}

}  // namespace vramd::client
