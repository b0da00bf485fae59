// HTTP/1.1 on libuv over a Unix socket (and optionally loopback TCP); requests are parsed by
// server/request_parser. Every limit a client could abuse is enforced here and refused with a
// clear HTTP error: header and body sizes, connections, idle and request timeouts. Requests on
// one connection are answered in order; while one is being answered, or while the answers the
// client has not taken pass max_unsent_bytes, the connection is not read (backpressure), and a
// disconnect is reported to whoever is answering it. Whatever the handler throws is answered
// with a 500 naming the request (server/boundary.hpp).
//
// Everything here runs on the loop thread, including every Exchange method.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>
#include <uv.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "config/daemon_config.hpp"
#include "server/request_parser.hpp"

namespace vramd::server {

class Connection;

// A handed-over connection (Exchange::upgrade) that the daemon may write to again: a lease
// that follows its model's updates.
class Channel {
 public:
  // Writes `bytes` with `fds` attached (SCM_RIGHTS), as the upgrade wrote its own. False when
  // the connection has closed, or has not yet taken what was written before, or the kernel
  // would not take the descriptors now.
  bool send(const std::string& bytes, const std::vector<int>& fds);

 private:
  friend class Connection;
  Connection* connection_ = nullptr;  // null once it closed
};

// One request and the answer to it. The answer is either whole (respond) or streamed in
// chunks (begin_stream, write, end). Once the client has gone, answering does nothing.
class Exchange {
 public:
  explicit Exchange(Connection* connection, Request request);
  const Request& request() const { return request_; }

  void respond(int status, std::string_view content_type, std::string body);
  void begin_stream(int status, std::string_view content_type);
  void write(std::string_view chunk);
  void end();

  bool answered() const { return state_ == State::Done; }
  bool streaming() const { return state_ == State::Streaming; }
  bool gone() const { return connection_ == nullptr; }
  // Bytes written but not yet taken by the client: stream writers skip updates while high.
  size_t unsent() const;
  // Called once if the client disconnects before the answer is complete.
  void on_gone(std::function<void()> callback) { on_gone_ = std::move(callback); }
  // What the daemon keeps for this connection's client (an update's memfd): the slot `key`,
  // empty at first, emptied when the connection closes. A connection whose slots hold anything
  // is not closed for being idle. Before the answer only: throws Error once the client is gone.
  std::shared_ptr<void>& held(const std::string& key);

  // Answers by handing the connection over (a lease): writes `bytes` with `fds` attached
  // (SCM_RIGHTS; the caller keeps its own descriptors), after which the connection carries no
  // more HTTP: what the client sends goes to `on_data` as it comes (ignored without one; false
  // there closes the connection), no timeout applies, and `on_end` runs once when it closes,
  // whoever closes it. Returns the connection as a Channel to write to again; null, keeping
  // nothing, when the client is gone, the connection is not a Unix socket, or the kernel would
  // not take the descriptors now.
  std::shared_ptr<Channel> upgrade(const std::string& bytes, const std::vector<int>& fds, std::function<void()> on_end,
                                   std::function<bool(std::string_view)> on_data = {});

 private:
  friend class Connection;
  void disconnect();

  enum class State { Waiting, Streaming, Done };
  Connection* connection_;
  Request request_;
  State state_ = State::Waiting;
  std::function<void()> on_gone_;
};

using Handler = std::function<void(std::shared_ptr<Exchange>)>;

// The socket's folder: made (0700) when missing (with `make`; without, a missing one is fine),
// and used only when it is a folder of this user or of root that nobody else may write, as tmux
// and ssh-agent insist: in a folder others can write, another user could take the socket's name
// first and stand in for the daemon. Throws Error naming the folder and the fix otherwise.
// Server::listen_unix checks it; `vramd --check` too, without making it.
void check_socket_folder(const std::string& socket_path, bool make = true);

// Who may use a Unix-socket connection: the daemon's own user, listed uids, members of a group.
struct Access {
  uid_t owner = 0;
  std::vector<uint32_t> uids;
  std::optional<gid_t> group;
};

class Server {
 public:
  Server(uv_loop_t* loop, const config::ServerLimits& limits, Access access, Handler handler);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Creates the socket (owner-only; group-writable with a group; open to all with listed uids,
  // whom SO_PEERCRED then checks) in a folder only its owner can write, made 0700 when missing.
  // A stale socket of this user's, left by a dead daemon, is replaced; a live one, one of
  // another user's or a folder others can write is not: throws Error.
  void listen_unix(const std::string& path);
  // Serves the listening socket systemd handed over (activated_socket()), which must be a Unix
  // stream socket listening at `path`: throws Error saying what it is instead. The socket file
  // is systemd's and stays when the daemon stops, so clients connect across restarts.
  void listen_activated(int fd, const std::string& path);
  void listen_tcp(const std::string& host_port);

  // Stops accepting and removes the socket file; connections already open carry on.
  void stop_listening();
  // Closes connections that have no request under way and nothing left to send.
  void close_idle();
  void close_all();
  size_t connections() const { return connections_.size(); }
  // Requests being answered, counting answers not yet taken by their clients.
  size_t exchanges_in_flight() const;

 private:
  friend class Connection;
  // A pipe handle on the loop, among the listeners stop_listening() closes.
  uv_pipe_t* add_pipe_listener();
  static void on_connection(uv_stream_t* listener, int status);
  void accept(uv_stream_t* listener, bool is_unix);
  bool allowed(int fd, ucred& credentials, std::string& peer, std::string& refusal) const;

  uv_loop_t* loop_;
  config::ServerLimits limits_;
  Access access_;
  Handler handler_;
  std::string socket_path_;
  std::vector<uv_stream_t*> listeners_;
  std::vector<Connection*> connections_;
};

// Socket activation as systemd does it (sd_listen_fds(3)): the socket is fd 3 when LISTEN_PID is
// this process and LISTEN_FDS is 1. The variables are removed either way, so that processes this
// daemon starts do not take them for theirs. nullopt when no socket was handed over; throws
// Error for more than one.
std::optional<int> activated_socket();

// "Not Found" for 404, and so on.
const char* status_text(int status);

}  // namespace vramd::server
