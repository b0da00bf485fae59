#include "server/http.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "server/boundary.hpp"
#include "server/reply.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/log.hpp"
#include "util/utf8.hpp"

namespace vramd::server {

const char* status_text(int status) {
  switch (status) {
    case 100: return "Continue";
    case 101: return "Switching Protocols";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 422: return "Unprocessable Content";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 507: return "Insufficient Storage";
    default: return status < 400 ? "OK" : "Error";
  }
}

// One client connection: parses requests, hands each to the server's handler as an
// Exchange, writes the answer, and enforces the limits. Reading stops while a request is being
// answered (every kHangUpCheck the socket is looked at for the client hanging up), and while
// more than max_unsent_bytes of answers wait for the client to take them.
class Connection {
 public:
  static constexpr std::chrono::milliseconds kHangUpCheck{100};

  Connection(Server& server, bool is_unix)
      : server_(server), is_unix_(is_unix), parser_({server.limits_.max_header_bytes, server.limits_.max_body_bytes}) {
    if (is_unix) uv_pipe_init(server.loop_, &handle_.pipe, 0);
    else uv_tcp_init(server.loop_, &handle_.tcp);
    handle_.stream.data = this;
    uv_timer_init(server.loop_, &timer_);
    timer_.data = this;
  }

  uv_stream_t* stream() { return &handle_.stream; }
  std::shared_ptr<void>& held(const std::string& key) { return held_[key]; }
  bool busy() const { return exchange_ != nullptr; }
  size_t unsent() const { return uv_stream_get_write_queue_size(&handle_.stream); }

  void start(const std::string& peer, int64_t uid = -1, int64_t pid = -1) {
    peer_ = peer;
    peer_uid_ = uid;
    peer_pid_ = pid;
    arm(server_.limits_.idle_timeout);
    uv_read_start(stream(), on_alloc, on_read);
  }

  // Answers with an error and closes the connection once it is written.
  void refuse(int status, const std::string& message) {
    log::debug("refused " + peer_ + ": " + std::to_string(status) + " " + message);
    keep_alive_ = false;
    uv_read_stop(stream());
    std::string body = json_line({{"error", message}});
    write_head(status, "application/json", body.size(), false);
    write_raw(std::move(body));
    close_after_writes();
  }

  void close() {
    if (closing_) return;
    closing_ = true;
    if (channel_) channel_->connection_ = nullptr;
    uv_read_stop(stream());
    if (auto on_end = std::move(on_upgrade_end_)) {
      log::debug(peer_ + ": the handed-over connection closed");
      on_end();
    }
    if (exchange_) {
      auto exchange = std::move(exchange_);
      exchange->disconnect();
    }
    held_.clear();
    auto& list = server_.connections_;
    list.erase(std::remove(list.begin(), list.end(), this), list.end());
    uv_close(reinterpret_cast<uv_handle_t*>(&handle_), on_closed);
    uv_close(reinterpret_cast<uv_handle_t*>(&timer_), on_closed);
  }

  // The Exchange's side.
  void write_head(int status, std::string_view content_type, size_t length, bool chunked) {
    std::string head = "HTTP/1.1 " + std::to_string(status) + " " + status_text(status) + "\r\nContent-Type: " +
                       std::string(content_type) + "\r\n";
    head += chunked ? "Transfer-Encoding: chunked\r\n" : "Content-Length: " + std::to_string(length) + "\r\n";
    if (!keep_alive_) head += "Connection: close\r\n";
    write_raw(head + "\r\n");
  }
  void write_raw(std::string data) {
    if (closing_ || data.empty()) return;
    auto* request = new WriteRequest{{}, std::move(data)};
    std::vector<uv_buf_t> bufs;  // uv_buf_t holds an unsigned length: 1 GiB pieces
    for (size_t at = 0; at < request->data.size(); at += size_t{1} << 30)
      bufs.push_back(uv_buf_init(request->data.data() + at,
                                 static_cast<unsigned>(std::min(request->data.size() - at, size_t{1} << 30))));
    request->req.data = this;
    if (uv_write(&request->req, stream(), bufs.data(), static_cast<unsigned>(bufs.size()), on_written) != 0) {
      delete request;
      close();
    }
  }
  std::shared_ptr<Channel> upgrade(const std::string& bytes, const std::vector<int>& fds, std::function<void()> on_end,
                                   std::function<bool(std::string_view)> on_data) {
    if (!is_unix_ || !send_with_fds(bytes, fds)) return nullptr;
    upgraded_ = true;
    exchange_.reset();
    uv_timer_stop(&timer_);
    on_upgrade_end_ = std::move(on_end);
    on_upgrade_data_ = std::move(on_data);
    pending_.clear();
    if (!closing_) uv_read_start(stream(), on_alloc, on_read);  // to see it close
    channel_ = std::make_shared<Channel>();
    channel_->connection_ = this;
    return channel_;
  }

  // `bytes` with `fds` attached: their first part by sendmsg (which carries the descriptors),
  // the rest queued as any write. False, having written nothing, when the connection is closing
  // or has not taken what was written before (the descriptors would arrive out of place).
  bool send_with_fds(const std::string& bytes, const std::vector<int>& fds) {
    if (closing_ || closing_after_writes_ || unsent() > 0 || bytes.empty()) return false;
    uv_os_fd_t fd = -1;
    if (uv_fileno(reinterpret_cast<uv_handle_t*>(stream()), &fd) != 0) return false;
    iovec data{const_cast<char*>(bytes.data()), bytes.size()};
    msghdr message{};
    message.msg_iov = &data;
    message.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
    if (!fds.empty()) {
      message.msg_control = control.data();
      message.msg_controllen = control.size();
      cmsghdr* header = CMSG_FIRSTHDR(&message);
      header->cmsg_level = SOL_SOCKET;
      header->cmsg_type = SCM_RIGHTS;
      header->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(header), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t sent;
    do sent = ::sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (sent < 0 && errno == EINTR);
    if (sent < 0) {
      log::info(peer_ + ": could not send descriptors: " + std::strerror(errno));
      return false;
    }
    write_raw(bytes.substr(static_cast<size_t>(sent)));
    return true;
  }

  void finish_exchange() {
    exchange_.reset();
    if (!keep_alive_) return close_after_writes();
    arm(server_.limits_.idle_timeout);
    // A client that sends requests without taking the answers is not read until it takes them.
    if (unsent() > server_.limits_.max_unsent_bytes) {
      held_back_ = true;
      log::debug(peer_ + ": " + std::to_string(unsent()) + " bytes of answers not taken; reading paused");
      return;
    }
    if (!in_handler_) read_on();  // else feed()'s caller reads on
  }

 private:
  struct WriteRequest {
    uv_write_t req;
    std::string data;
  };

  void arm(std::chrono::milliseconds timeout) {
    uv_timer_start(&timer_, on_timeout, static_cast<uint64_t>(timeout.count()), 0);
  }

  void close_after_writes() {
    closing_after_writes_ = true;
    uv_read_stop(stream());
    if (unsent() == 0) close();
    else arm(server_.limits_.idle_timeout);  // a client that never reads is dropped
  }

  // Once an answer is written: the requests already read, one after another (a loop, not a
  // recursion, however many a client pipelined), then the socket again.
  void read_on() {
    while (!closing_ && !closing_after_writes_ && !exchange_ && !held_back_) {
      if (pending_.empty()) {
        uv_read_start(stream(), on_alloc, on_read);
        return;
      }
      const std::string rest = std::exchange(pending_, {});
      feed(rest.data(), rest.size());
    }
  }

  // Returns true when a whole request was read (and handed to the handler).
  bool feed(const char* data, size_t size) {
    const auto step = parser_.feed(data, size);
    if (step.began) arm(server_.limits_.request_timeout);
    if (step.wants_continue) write_raw("HTTP/1.1 100 Continue\r\n\r\n");
    if (step.result == RequestParser::Result::More) return false;
    if (step.result == RequestParser::Result::Refused) {
      refuse(parser_.refusal_status(), parser_.refusal());
      return false;
    }
    // A whole request: answer it before reading on.
    keep_alive_ = parser_.keep_alive();
    uv_timer_stop(&timer_);
    uv_read_stop(stream());
    pending_.assign(data + step.consumed, size - step.consumed);
    Request request = parser_.take();
    request.peer = peer_;
    request.peer_uid = peer_uid_;
    request.peer_pid = peer_pid_;
    const auto exchange = exchange_ = std::make_shared<Exchange>(this, std::move(request));
    const auto where = [&] {
      return "answering " + exchange->request().method + " " + escape_invalid_utf8(exchange->request().path) +
             " from " + peer_;
    };
    in_handler_ = true;
    if (auto fault = guarded(where, [&] { server_.handler_(exchange); })) {
      if (exchange->streaming()) exchange->end();
      else exchange->respond(500, "application/json", json_line({{"error", "vramd failed while " + where() + ": " + *fault}}));
    }
    in_handler_ = false;
    // Answered later (a job): the socket is not read meanwhile, so look for the client hanging up.
    if (exchange_ == exchange) uv_timer_start(&timer_, on_timeout, kHangUpCheck.count(), kHangUpCheck.count());
    return true;
  }

  // Whether the client has gone while its answer is being made. Over a Unix socket only a close
  // counts (a client that shuts down its sending side still gets its answer); over TCP, whose
  // close looks the same until the next write, the end of its requests does, as in most servers.
  bool hung_up() {
    uv_os_fd_t fd = -1;
    if (uv_fileno(reinterpret_cast<uv_handle_t*>(stream()), &fd) != 0) return false;
    pollfd p{fd, POLLRDHUP, 0};
    if (::poll(&p, 1, 0) != 1) return false;
    return (p.revents & (POLLHUP | POLLERR)) || (!is_unix_ && (p.revents & POLLRDHUP));
  }

  // What guarded() names when reading from this client fails.
  auto reading_from() const {
    return [this] { return "reading from " + peer_; };
  }

  static void on_alloc(uv_handle_t* handle, size_t, uv_buf_t* buf) {
    auto* self = static_cast<Connection*>(handle->data);
    *buf = uv_buf_init(self->buffer_.data(), static_cast<unsigned>(self->buffer_.size()));
  }

  static void on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf) {
    auto* self = static_cast<Connection*>(stream->data);
    if (nread < 0) return self->close();
    if (nread > 0 && self->upgraded_ && self->on_upgrade_data_ && !self->closing_) {
      // What the client says on a handed-over connection; what the listener refuses ends it.
      const auto bytes = std::string_view(buf->base, static_cast<size_t>(nread));
      bool heard = false;
      if (guarded(self->reading_from(), [&] { heard = self->on_upgrade_data_(bytes); }) || !heard) self->close();
      return;
    }
    if (nread == 0 || self->closing_after_writes_ || self->upgraded_) return;
    const auto fault = guarded(self->reading_from(), [&] {
      if (self->feed(buf->base, static_cast<size_t>(nread))) self->read_on();
    });
    if (fault) self->close();
  }

  static void on_written(uv_write_t* req, int status) {
    auto* request = reinterpret_cast<WriteRequest*>(req);
    auto* self = static_cast<Connection*>(req->data);
    delete request;
    if (status == UV_ECANCELED) return;  // the connection is closing; `self` may be gone
    if (status < 0) return self->close();
    if (self->closing_after_writes_ && self->unsent() == 0) return self->close();
    if (self->held_back_ && self->unsent() <= self->server_.limits_.max_unsent_bytes / 2) {
      self->held_back_ = false;
      if (guarded(self->reading_from(), [&] { self->read_on(); })) return self->close();
    }
    // A client still taking its answer is not idle: only one that stops reading times out.
    if (!self->exchange_ && !self->parser_.receiving() && !self->upgraded_) self->arm(self->server_.limits_.idle_timeout);
  }

  static void on_timeout(uv_timer_t* timer) {
    auto* self = static_cast<Connection*>(timer->data);
    if (self->upgraded_) return;
    if (self->exchange_) {
      if (self->hung_up()) {
        log::debug(self->peer_ + " hung up before its answer");
        self->close();
      }
      return;
    }
    if (self->parser_.receiving())
      return self->refuse(408, "request not received within " +
                                   std::to_string(self->server_.limits_.request_timeout.count()) + " ms");
    if (self->held_back_) log::info("closing the connection of " + self->peer_ + ": it took none of its " +
                                    std::to_string(self->unsent()) + " bytes of answers in time");
    else if (std::any_of(self->held_.begin(), self->held_.end(), [](const auto& slot) { return slot.second != nullptr; }))
      return;  // idle, but holding what the daemon keeps for its client: closed by the client
    self->close();  // idle, or a client that does not read its answer
  }

  static void on_closed(uv_handle_t* handle) {
    auto* self = static_cast<Connection*>(handle->data);
    if (++self->closed_handles_ == 2) delete self;
  }

  Server& server_;
  bool is_unix_;
  union {
    uv_stream_t stream;
    uv_pipe_t pipe;
    uv_tcp_t tcp;
  } handle_;
  uv_timer_t timer_;
  RequestParser parser_;
  std::array<char, 64 << 10> buffer_;
  std::string peer_;
  int64_t peer_uid_ = -1, peer_pid_ = -1;
  std::string pending_;
  std::map<std::string, std::shared_ptr<void>> held_;  // Exchange::held
  bool keep_alive_ = true, held_back_ = false, in_handler_ = false, upgraded_ = false;
  std::function<void()> on_upgrade_end_;
  std::function<bool(std::string_view)> on_upgrade_data_;
  std::shared_ptr<Channel> channel_;  // once upgraded
  bool closing_ = false, closing_after_writes_ = false;
  int closed_handles_ = 0;
  std::shared_ptr<Exchange> exchange_;
};

Exchange::Exchange(Connection* connection, Request request) : connection_(connection), request_(std::move(request)) {}

void Exchange::respond(int status, std::string_view content_type, std::string body) {
  if (state_ != State::Waiting) return;
  state_ = State::Done;
  if (!connection_) return;
  connection_->write_head(status, content_type, body.size(), false);
  connection_->write_raw(std::move(body));
  auto* connection = std::exchange(connection_, nullptr);
  connection->finish_exchange();
}

void Exchange::begin_stream(int status, std::string_view content_type) {
  if (state_ != State::Waiting) return;
  state_ = State::Streaming;
  if (connection_) connection_->write_head(status, content_type, 0, true);
}

void Exchange::write(std::string_view chunk) {
  if (state_ != State::Streaming || !connection_ || chunk.empty()) return;
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", chunk.size());
  connection_->write_raw(std::string(size) + std::string(chunk) + "\r\n");
}

void Exchange::end() {
  if (state_ != State::Streaming) return;
  state_ = State::Done;
  if (!connection_) return;
  connection_->write_raw("0\r\n\r\n");
  auto* connection = std::exchange(connection_, nullptr);
  connection->finish_exchange();
}

std::shared_ptr<Channel> Exchange::upgrade(const std::string& bytes, const std::vector<int>& fds,
                                           std::function<void()> on_end, std::function<bool(std::string_view)> on_data) {
  if (state_ != State::Waiting || !connection_) return nullptr;
  auto channel = connection_->upgrade(bytes, fds, std::move(on_end), std::move(on_data));
  if (!channel) return nullptr;
  state_ = State::Done;
  connection_ = nullptr;
  return channel;
}

bool Channel::send(const std::string& bytes, const std::vector<int>& fds) {
  return connection_ && connection_->send_with_fds(bytes, fds);
}

size_t Exchange::unsent() const { return connection_ ? connection_->unsent() : 0; }

std::shared_ptr<void>& Exchange::held(const std::string& key) {
  if (!connection_) throw Error("the client is gone");
  return connection_->held(key);
}

void Exchange::disconnect() {
  connection_ = nullptr;
  if (state_ == State::Done) return;
  state_ = State::Done;
  if (auto callback = std::move(on_gone_)) callback();
}

Server::Server(uv_loop_t* loop, const config::ServerLimits& limits, Access access, Handler handler)
    : loop_(loop), limits_(limits), access_(std::move(access)), handler_(std::move(handler)) {}

Server::~Server() {
  stop_listening();
  close_all();
}

namespace {

// Whether something answers on the socket at `path`: a live daemon.
bool socket_is_live(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof address.sun_path - 1);
  const bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 || errno == EAGAIN;
  ::close(fd);
  return live;
}

void check_uv(int status, const std::string& what) {
  if (status < 0) throw Error(what + ": " + uv_strerror(status));
}

}  // namespace

uv_pipe_t* Server::add_pipe_listener() {
  auto* pipe = new uv_pipe_t;
  uv_pipe_init(loop_, pipe, 0);
  pipe->data = this;
  listeners_.push_back(reinterpret_cast<uv_stream_t*>(pipe));
  return pipe;
}

// The socket appears at `path` only once it listens: it is bound under a name of its own beside
// `path`, made to listen, then linked to `path` (which fails where another daemon's socket got
// there first) and its own name removed. A client that waits for the file never finds it refusing.
void check_socket_folder(const std::string& socket_path, bool make) {
  std::string folder = socket_path.substr(0, socket_path.rfind('/') == std::string::npos ? 0 : socket_path.rfind('/'));
  if (folder.empty()) folder = socket_path.starts_with('/') ? "/" : ".";
  struct stat missing {};
  if (!make && ::stat(folder.c_str(), &missing) != 0 && errno == ENOENT) return;  // made, owner-only, when the daemon starts
  if (make && ::mkdir(folder.c_str(), 0700) != 0 && errno != EEXIST)
    fail(folder, std::string("cannot create the socket's folder: ") + std::strerror(errno));
  struct stat info {};
  if (::stat(folder.c_str(), &info) != 0) fail(folder, std::string("cannot use the socket's folder: ") + std::strerror(errno));
  if (!S_ISDIR(info.st_mode)) fail(folder, "the socket's folder is not a folder");
  if (info.st_uid != ::geteuid() && info.st_uid != 0)
    fail(folder, "the socket's folder belongs to uid " + std::to_string(info.st_uid) +
                     ", not to this daemon's user (uid " + std::to_string(::geteuid()) + ") or root; choose another socket path");
  if (info.st_mode & (S_IWGRP | S_IWOTH)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 07777));
    fail(folder, std::string("others may write the socket's folder (mode ") + mode +
                     "), so they could take the socket's place; use a folder only its owner can write, such as "
                     "the default ($XDG_RUNTIME_DIR/vramd/ or /tmp/vramd-UID/)");
  }
}

void Server::listen_unix(const std::string& path) {
  const std::string bound_at = path + "." + std::to_string(::getpid());
  constexpr size_t kLongest = sizeof(sockaddr_un{}.sun_path) - 1;
  if (bound_at.size() > kLongest)
    fail(path, "socket path longer than " + std::to_string(kLongest - (bound_at.size() - path.size())) + " bytes");
  check_socket_folder(path);
  struct stat info {};
  if (::lstat(path.c_str(), &info) == 0) {
    if (!S_ISSOCK(info.st_mode)) fail(path, "exists and is not a socket; remove it or choose another socket path");
    if (info.st_uid != ::geteuid())
      fail(path, "a socket of uid " + std::to_string(info.st_uid) + " is in the way; vramd removes only its own");
    if (socket_is_live(path)) fail(path, "another vramd is serving this socket; stop it first or choose another socket path");
    log::info("replacing the stale socket " + path + " left by a daemon that did not exit cleanly");
    ::unlink(path.c_str());
  }
  ::unlink(bound_at.c_str());  // left by a daemon of this pid that was killed (a pid namespace's)
  uv_pipe_t* pipe = add_pipe_listener();
  const mode_t old_mask = ::umask(0177);  // no moment where others could connect
  const int bound = uv_pipe_bind(pipe, bound_at.c_str());
  ::umask(old_mask);
  check_uv(bound, "cannot create the socket " + path);
  const auto refuse = [&](const std::string& why) {
    ::unlink(bound_at.c_str());
    fail(path, why);
  };
  mode_t mode = 0600;
  if (access_.group) {
    mode = 0660;
    if (::chown(bound_at.c_str(), static_cast<uid_t>(-1), *access_.group) != 0)
      refuse(std::string("cannot give the socket to the configured group: ") + std::strerror(errno));
  }
  if (!access_.uids.empty()) mode = 0666;  // listed users get in; SO_PEERCRED checks each connection
  ::chmod(bound_at.c_str(), mode);
  if (const int listening = uv_listen(reinterpret_cast<uv_stream_t*>(pipe), 128, on_connection); listening < 0)
    refuse(std::string("cannot listen: ") + uv_strerror(listening));
  if (::link(bound_at.c_str(), path.c_str()) != 0)
    refuse(errno == EEXIST ? "another vramd is serving this socket; stop it first or choose another socket path"
                           : std::string("cannot create the socket: ") + std::strerror(errno));
  ::unlink(bound_at.c_str());
  socket_path_ = path;
}

std::optional<int> activated_socket() {
  const char* pid = std::getenv("LISTEN_PID");
  const char* fds = std::getenv("LISTEN_FDS");
  const bool ours = pid && fds && std::string(pid) == std::to_string(::getpid());
  const std::string count = fds ? fds : "";
  for (const char* name : {"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"}) ::unsetenv(name);
  if (!ours) return std::nullopt;
  if (count != "1")
    throw Error("socket activation: LISTEN_FDS=" + escape_invalid_utf8(count) +
                ", and vramd serves one socket: give its .socket unit one ListenStream=");
  return 3;  // SD_LISTEN_FDS_START
}

void Server::listen_activated(int fd, const std::string& path) {
  const std::string what = "the socket systemd handed over (fd " + std::to_string(fd) + ")";
  int type = 0, listening = 0;
  socklen_t size = sizeof type;
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &size) != 0) fail(what, std::string("not a socket: ") + std::strerror(errno));
  sockaddr_un address{};
  socklen_t address_size = sizeof address;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &address_size) != 0 || address.sun_family != AF_UNIX ||
      type != SOCK_STREAM)
    fail(what, "not a Unix stream socket: vramd's .socket unit needs ListenStream=/path/to/vramd.sock");
  size = sizeof listening;
  if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) != 0 || !listening) fail(what, "not listening");
  const size_t path_bytes = address_size > offsetof(sockaddr_un, sun_path) ? address_size - offsetof(sockaddr_un, sun_path) : 0;
  const std::string bound(address.sun_path, ::strnlen(address.sun_path, path_bytes));
  if (bound != path)
    fail(what, "listens at " + quote(bound) + ", but this daemon's socket is " + quote(path) +
                   ", where vramctl looks: make the daemon config's socket and the unit's ListenStream= the same");
  uv_pipe_t* pipe = add_pipe_listener();
  check_uv(uv_pipe_open(pipe, fd), "cannot use " + what);
  check_uv(uv_listen(reinterpret_cast<uv_stream_t*>(pipe), 128, on_connection), "cannot listen on " + path);
}

void Server::listen_tcp(const std::string& host_port) {
  const auto colon = host_port.rfind(':');
  sockaddr_in address{};
  check_uv(uv_ip4_addr(host_port.substr(0, colon).c_str(), std::stoi(host_port.substr(colon + 1)), &address), "tcp " + host_port);
  auto* tcp = new uv_tcp_t;
  uv_tcp_init(loop_, tcp);
  tcp->data = this;
  listeners_.push_back(reinterpret_cast<uv_stream_t*>(tcp));
  check_uv(uv_tcp_bind(tcp, reinterpret_cast<sockaddr*>(&address), 0), "cannot bind tcp " + host_port);
  check_uv(uv_listen(reinterpret_cast<uv_stream_t*>(tcp), 128, on_connection), "cannot listen on tcp " + host_port);
}

void Server::stop_listening() {
  for (auto* listener : listeners_)
    uv_close(reinterpret_cast<uv_handle_t*>(listener), [](uv_handle_t* handle) {
      if (handle->type == UV_NAMED_PIPE) delete reinterpret_cast<uv_pipe_t*>(handle);
      else delete reinterpret_cast<uv_tcp_t*>(handle);
    });
  listeners_.clear();
  if (!socket_path_.empty()) ::unlink(socket_path_.c_str());
  socket_path_.clear();
}

void Server::close_idle() {
  for (auto* connection : std::vector<Connection*>(connections_))
    if (!connection->busy() && connection->unsent() == 0) connection->close();
}

void Server::close_all() {
  for (auto* connection : std::vector<Connection*>(connections_)) connection->close();
}

size_t Server::exchanges_in_flight() const {
  return static_cast<size_t>(std::count_if(connections_.begin(), connections_.end(),
                                           [](Connection* c) { return c->busy() || c->unsent() > 0; }));
}

void Server::on_connection(uv_stream_t* listener, int status) {
  if (status < 0) return log::warn(std::string("accept failed: ") + uv_strerror(status));
  static_cast<Server*>(listener->data)->accept(listener, listener->type == UV_NAMED_PIPE);
}

bool Server::allowed(int fd, ucred& credentials, std::string& peer, std::string& refusal) const {
  socklen_t length = sizeof credentials;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    refusal = "cannot identify the client (SO_PEERCRED failed)";
    return false;
  }
  peer = "uid " + std::to_string(credentials.uid) + " pid " + std::to_string(credentials.pid);
  if (credentials.uid == access_.owner) return true;
  if (std::find(access_.uids.begin(), access_.uids.end(), credentials.uid) != access_.uids.end()) return true;
  if (access_.group) {
    if (credentials.gid == *access_.group) return true;
    std::ifstream status("/proc/" + std::to_string(credentials.pid) + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (!line.starts_with("Groups:")) continue;
      std::istringstream groups(line.substr(7));
      for (gid_t gid; groups >> gid;)
        if (gid == *access_.group) return true;
    }
  }
  refusal = "uid " + std::to_string(credentials.uid) + " may not use this daemon; its config's [access] lists who may";
  return false;
}

void Server::accept(uv_stream_t* listener, bool is_unix) {
  auto* connection = new Connection(*this, is_unix);
  connections_.push_back(connection);
  if (uv_accept(listener, connection->stream()) != 0) return connection->close();
  std::string peer = "tcp", refusal;
  uv_os_fd_t fd = -1;
  uv_fileno(reinterpret_cast<uv_handle_t*>(connection->stream()), &fd);
  if (connections_.size() > limits_.max_connections) {
    connection->start(peer);
    return connection->refuse(503, "too many connections (limit " + std::to_string(limits_.max_connections) + ")");
  }
  ucred credentials{0, static_cast<uid_t>(-1), static_cast<gid_t>(-1)};
  if (is_unix && !allowed(fd, credentials, peer, refusal)) {
    connection->start(peer);
    log::warn("refused a connection from " + peer + ": " + refusal);
    return connection->refuse(403, refusal);
  }
  if (is_unix) connection->start(peer, credentials.uid, credentials.pid);
  else connection->start(peer);
}

}  // namespace vramd::server
