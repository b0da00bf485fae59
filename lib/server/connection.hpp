// One client connection of the daemon's HTTP server (server/http.hpp), for http.cpp and
// connection.cpp alone: libuv and the request parser show here.
#pragma once

#include <uv.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/http.hpp"
#include "server/request_parser.hpp"

namespace vramd::server {

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

  void start(const std::string& peer, int64_t uid = -1, int64_t pid = -1);

  // Answers with an error and closes the connection once it is written.
  void refuse(int status, const std::string& message);

  void close();

  // The Exchange's side.
  void write_head(int status, std::string_view content_type, size_t length, bool chunked);
  // `data`, after `head` where there is one, in one write (one writev: a response's head and body
  // in one system call, the client woken once). What the socket takes at once costs no
  // allocation; what it does not is copied (`head`) or moved (`data`) into the queued write.
  void write_raw(std::string data, std::string_view head = {});
  // A whole response: its head and `body` in one write.
  void write_response(int status, std::string_view content_type, std::string body);
  std::shared_ptr<Channel> upgrade(const std::string& bytes, const std::vector<int>& fds, std::function<void()> on_end,
                                   std::function<bool(std::string_view)> on_data);

  // `bytes` with `fds` attached: their first part by sendmsg (which carries the descriptors),
  // the rest queued as any write. False, having written nothing, when the connection is closing
  // or has not taken what was written before (the descriptors would arrive out of place).
  bool send_with_fds(const std::string& bytes, const std::vector<int>& fds);

  void finish_exchange();

 private:
  struct WriteRequest {
    uv_write_t req;
    std::string head, data;
  };
  // A response's status line and headers, written in place (every answer makes one).
  class Head {
   public:
    Head& operator<<(std::string_view text);
    std::string_view text() const { return {text_.data(), size_}; }

   private:
    std::array<char, 256> text_;
    size_t size_ = 0;
  };
  Head head(int status, std::string_view content_type, size_t length, bool chunked) const;

  // The connection's one deadline (idle, or a request's), `timeout` from the loop's now. A
  // request moves it several times; the timer is restarted only to fire sooner, and one that
  // fires before the deadline waits on for the rest (heap updates cost 7% of a status request).
  void arm(std::chrono::milliseconds timeout);
  void disarm() { deadline_ = 0; }
  void start_timer(uint64_t timeout, uint64_t repeat = 0);
  void pause_reading();
  void resume_reading();

  void close_after_writes();

  // Once an answer is written: the requests already read, one after another (a loop, not a
  // recursion, however many a client pipelined), then the socket again.
  void read_on();

  // Returns true when a whole request was read (and handed to the handler).
  bool feed(const char* data, size_t size);

  // Whether the client has gone while its answer is being made. Over a Unix socket only a close
  // counts (a client that shuts down its sending side still gets its answer); over TCP, whose
  // close looks the same until the next write, the end of its requests does, as in most servers.
  bool hung_up();

  // What guarded() names when reading from this client fails.
  auto reading_from() const;

  static void on_alloc(uv_handle_t* handle, size_t, uv_buf_t* buf);

  static void on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf);

  static void on_written(uv_write_t* req, int status);

  static void on_timeout(uv_timer_t* timer);

  static void on_closed(uv_handle_t* handle);

  Server& server_;
  bool is_unix_;
  union {
    uv_stream_t stream;
    uv_pipe_t pipe;
    uv_tcp_t tcp;
  } handle_;
  uv_timer_t timer_;
  uint64_t deadline_ = 0;   // in the loop's ms; 0: none
  uint64_t timer_due_ = 0;  // when timer_ fires next, while it runs
  bool checking_hang_up_ = false;  // timer_ repeats to look for a client gone (an answer made later)
  RequestParser parser_;
  std::array<char, 64 << 10> buffer_;
  std::string peer_;
  int64_t peer_uid_ = -1, peer_pid_ = -1;
  std::string pending_;
  std::map<std::string, std::shared_ptr<void>> held_;  // Exchange::held
  bool keep_alive_ = true, held_back_ = false, in_handler_ = false, upgraded_ = false;
  bool reading_ = false;  // the stream is being read (uv_read_start'ed)
  std::function<void()> on_upgrade_end_;
  std::function<bool(std::string_view)> on_upgrade_data_;
  std::shared_ptr<Channel> channel_;  // once upgraded
  bool closing_ = false, closing_after_writes_ = false;
  int closed_handles_ = 0;
  std::shared_ptr<Exchange> exchange_;
};

}  // namespace vramd::server
