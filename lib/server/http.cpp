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
#include "server/connection.hpp"
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
