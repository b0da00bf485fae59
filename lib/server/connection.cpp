#include "server/connection.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "server/boundary.hpp"
#include "server/reply.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/log.hpp"
#include "util/utf8.hpp"

namespace vramd::server {

void Connection::start(const std::string& peer, int64_t uid, int64_t pid) {
  peer_ = peer;
  peer_uid_ = uid;
  peer_pid_ = pid;
  arm(server_.limits_.idle_timeout);
  resume_reading();
}

void Connection::pause_reading() {
  if (reading_) uv_read_stop(stream());
  reading_ = false;
}

void Connection::resume_reading() {
  if (!reading_) uv_read_start(stream(), on_alloc, on_read);
  reading_ = true;
}

void Connection::refuse(int status, const std::string& message) {
  log::debug("refused " + peer_ + ": " + std::to_string(status) + " " + message);
  keep_alive_ = false;
  pause_reading();
  write_response(status, "application/json", json_line({{"error", message}}));
  close_after_writes();
}

void Connection::close() {
  if (closing_) return;
  closing_ = true;
  if (channel_) channel_->connection_ = nullptr;
  pause_reading();
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

Connection::Head& Connection::Head::operator<<(std::string_view text) {
  if (text.size() > text_.size() - size_) throw std::logic_error("a response's head over " + std::to_string(text_.size()) + " bytes");
  std::memcpy(text_.data() + size_, text.data(), text.size());
  size_ += text.size();
  return *this;
}

Connection::Head Connection::head(int status, std::string_view content_type, size_t length, bool chunked) const {
  char number[24];
  const auto text = [&](auto n) { return std::string_view(number, std::to_chars(number, number + sizeof number, n).ptr); };
  Head head;
  head << "HTTP/1.1 " << text(status) << " " << status_text(status) << "\r\nContent-Type: " << content_type << "\r\n";
  if (chunked) head << "Transfer-Encoding: chunked\r\n";
  else head << "Content-Length: " << text(length) << "\r\n";
  if (!keep_alive_) head << "Connection: close\r\n";
  head << "\r\n";
  return head;
}

void Connection::write_head(int status, std::string_view content_type, size_t length, bool chunked) {
  write_raw({}, head(status, content_type, length, chunked).text());
}

void Connection::write_response(int status, std::string_view content_type, std::string body) {
  const Head line = head(status, content_type, body.size(), false);
  write_raw(std::move(body), line.text());
}

void Connection::write_raw(std::string data, std::string_view head) {
  if (closing_ || (data.empty() && head.empty())) return;
  // Written now where the socket takes it all (an answer of a few kilobytes nearly always):
  // uv_write would finish it on the loop's next turn, and stop watching for room to write then,
  // an epoll change each answer. What it does not take is queued after it. A failure is left
  // to uv_write to report, on the loop's next turn: callers go on with the connection as it is.
  constexpr size_t kPiece = size_t{1} << 30;  // uv_buf_t holds an unsigned length: 1 GiB pieces
  size_t written = 0;
  if (unsent() == 0 && data.size() < kPiece) {
    std::array<uv_buf_t, 2> now;
    unsigned n = 0;
    if (!head.empty()) now[n++] = uv_buf_init(const_cast<char*>(head.data()), static_cast<unsigned>(head.size()));
    if (!data.empty()) now[n++] = uv_buf_init(data.data(), static_cast<unsigned>(data.size()));
    written = static_cast<size_t>(std::max(0, uv_try_write(stream(), now.data(), n)));
    if (written == head.size() + data.size()) return;
  }
  const size_t from_head = std::min(written, head.size());
  auto* request = new WriteRequest{{}, std::string(head.substr(from_head)), std::move(data)};
  const size_t from_data = written - from_head;
  // An answer under 3 GiB needs no vector.
  const size_t left = request->data.size() - from_data;
  const size_t pieces = !request->head.empty() + (left + kPiece - 1) / kPiece;
  std::array<uv_buf_t, 4> few;
  std::vector<uv_buf_t> many(pieces > few.size() ? pieces : 0);
  uv_buf_t* bufs = many.empty() ? few.data() : many.data();
  size_t n = 0;
  if (!request->head.empty()) bufs[n++] = uv_buf_init(request->head.data(), static_cast<unsigned>(request->head.size()));
  for (size_t at = from_data; at < request->data.size(); at += kPiece)
    bufs[n++] = uv_buf_init(request->data.data() + at, static_cast<unsigned>(std::min(request->data.size() - at, kPiece)));
  request->req.data = this;
  if (uv_write(&request->req, stream(), bufs, static_cast<unsigned>(n), on_written) != 0) {
    delete request;
    close();
  }
}

std::shared_ptr<Channel> Connection::upgrade(const std::string& bytes, const std::vector<int>& fds, std::function<void()> on_end,
                                 std::function<bool(std::string_view)> on_data) {
  if (!is_unix_ || !send_with_fds(bytes, fds)) return nullptr;
  upgraded_ = true;
  exchange_.reset();
  disarm();
  checking_hang_up_ = false;
  uv_timer_stop(&timer_);
  on_upgrade_end_ = std::move(on_end);
  on_upgrade_data_ = std::move(on_data);
  pending_.clear();
  if (!closing_) resume_reading();  // to see it close
  channel_ = std::make_shared<Channel>();
  channel_->connection_ = this;
  return channel_;
}

bool Connection::send_with_fds(const std::string& bytes, const std::vector<int>& fds) {
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

void Connection::finish_exchange() {
  exchange_.reset();
  if (!keep_alive_) return close_after_writes();
  arm(server_.limits_.idle_timeout);
  // A client that sends requests without taking the answers is not read until it takes them.
  if (unsent() > server_.limits_.max_unsent_bytes) {
    held_back_ = true;
    pause_reading();
    log::debug(peer_ + ": " + std::to_string(unsent()) + " bytes of answers not taken; reading paused");
    return;
  }
  if (!in_handler_) read_on();  // else feed()'s caller reads on
}

void Connection::arm(std::chrono::milliseconds timeout) {
  const uint64_t now = uv_now(server_.loop_);
  deadline_ = now + static_cast<uint64_t>(timeout.count());
  if (checking_hang_up_ || !uv_is_active(reinterpret_cast<uv_handle_t*>(&timer_)) || timer_due_ > deadline_)
    start_timer(deadline_ - now);
}

void Connection::start_timer(uint64_t timeout, uint64_t repeat) {
  checking_hang_up_ = repeat != 0;
  timer_due_ = uv_now(server_.loop_) + timeout;
  uv_timer_start(&timer_, on_timeout, timeout, repeat);
}

void Connection::close_after_writes() {
  closing_after_writes_ = true;
  pause_reading();
  if (unsent() == 0) close();
  else arm(server_.limits_.idle_timeout);  // a client that never reads is dropped
}

void Connection::read_on() {
  while (!closing_ && !closing_after_writes_ && !exchange_ && !held_back_) {
    if (pending_.empty()) {
      resume_reading();
      return;
    }
    const std::string rest = std::exchange(pending_, {});
    feed(rest.data(), rest.size());
  }
}

bool Connection::feed(const char* data, size_t size) {
  const auto step = parser_.feed(data, size);
  if (step.began) arm(server_.limits_.request_timeout);
  if (step.wants_continue) write_raw("HTTP/1.1 100 Continue\r\n\r\n");
  if (step.result == RequestParser::Result::More) return false;
  if (step.result == RequestParser::Result::Refused) {
    refuse(parser_.refusal_status(), parser_.refusal());
    return false;
  }
  // A whole request: answer it before reading on (nothing is read while the handler runs; one
  // answered later pauses reading below, one answered at once goes on without a pause, which
  // would cost two epoll changes a request).
  keep_alive_ = parser_.keep_alive();
  disarm();
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
  if (exchange_ == exchange) {
    pause_reading();
    disarm();
    start_timer(kHangUpCheck.count(), kHangUpCheck.count());
  }
  return true;
}

bool Connection::hung_up() {
  uv_os_fd_t fd = -1;
  if (uv_fileno(reinterpret_cast<uv_handle_t*>(stream()), &fd) != 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) != 1) return false;
  return (p.revents & (POLLHUP | POLLERR)) || (!is_unix_ && (p.revents & POLLRDHUP));
}

auto Connection::reading_from() const {
  return [this] { return "reading from " + peer_; };
}

void Connection::on_alloc(uv_handle_t* handle, size_t, uv_buf_t* buf) {
  auto* self = static_cast<Connection*>(handle->data);
  *buf = uv_buf_init(self->buffer_.data(), static_cast<unsigned>(self->buffer_.size()));
}

void Connection::on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf) {
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

void Connection::on_written(uv_write_t* req, int status) {
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

void Connection::on_timeout(uv_timer_t* timer) {
  auto* self = static_cast<Connection*>(timer->data);
  if (self->upgraded_) return;
  if (!self->checking_hang_up_) {  // the deadline may have moved since the timer was started
    const uint64_t now = uv_now(self->server_.loop_);
    if (self->deadline_ == 0) return;
    if (now < self->deadline_) return self->start_timer(self->deadline_ - now);
    self->deadline_ = 0;
  }
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

void Connection::on_closed(uv_handle_t* handle) {
  auto* self = static_cast<Connection*>(handle->data);
  if (++self->closed_handles_ == 2) delete self;
}

Exchange::Exchange(Connection* connection, Request request) : connection_(connection), request_(std::move(request)) {}

void Exchange::respond(int status, std::string_view content_type, std::string body) {
  if (state_ != State::Waiting) return;
  state_ = State::Done;
  if (!connection_) return;
  connection_->write_response(status, content_type, std::move(body));
  // A write that failed at once closed the connection, which disconnected this exchange.
  if (auto* connection = std::exchange(connection_, nullptr)) connection->finish_exchange();
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
  if (auto* connection = std::exchange(connection_, nullptr)) connection->finish_exchange();  // as respond()
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

}  // namespace vramd::server
