// HTTP/1.1 requests from bytes, with Node's http-parser: one request at a time, each limit a
// client could abuse refused with its status and a message. No libuv here: the connection
// feeds it what it reads, and the fuzzer feeds it anything (fuzz/fuzz_http_request.cpp).
#pragma once

#include <http_parser.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace vramd::server {

struct Request {
  std::string method;  // "GET"
  std::string path;    // "/v1/models", percent-decoded: any bytes, not only UTF-8
  std::map<std::string, std::string> query;                 // decoded
  std::vector<std::pair<std::string, std::string>> headers;  // names in lower case
  std::string body;
  std::string peer;  // "uid 1000 pid 4242", or "tcp"
  int64_t peer_uid = -1, peer_pid = -1;  // of a Unix-socket client, from SO_PEERCRED

  const std::string* header(std::string_view name) const;  // `name` in lower case
};

struct RequestLimits {
  uint64_t max_header_bytes = 64 << 10;  // request line and headers
  uint64_t max_body_bytes = uint64_t{2} << 30;
};

class RequestParser {
 public:
  explicit RequestParser(RequestLimits limits);
  RequestParser(const RequestParser&) = delete;
  RequestParser& operator=(const RequestParser&) = delete;

  enum class Result { More, Complete, Refused };
  struct Step {
    Result result = Result::More;
    size_t consumed = 0;         // bytes taken; after Complete the rest belongs to later requests
    bool began = false;          // a request started in these bytes
    bool wants_continue = false; // its headers asked for "Expect: 100-continue"
  };
  // Parses until one request is complete, the bytes run out, or the request is refused. After
  // Complete, take() the request before feeding more; after Refused, feed nothing more.
  Step feed(const char* data, size_t size);
  Request take();

  bool receiving() const { return receiving_; }    // a request has begun and is not complete
  bool keep_alive() const { return keep_alive_; }  // of the request last completed
  int refusal_status() const { return refusal_status_; }
  const std::string& refusal() const { return refusal_; }

 private:
  static const http_parser_settings& settings();
  bool count_header_bytes(size_t n);
  void refuse(int status, std::string message);

  RequestLimits limits_;
  http_parser parser_;
  Request request_;
  std::string url_;
  size_t header_bytes_ = 0;
  bool last_was_value_ = false, receiving_ = false, keep_alive_ = true;
  bool began_ = false, wants_continue_ = false;
  int refusal_status_ = 0;
  std::string refusal_;
};

// "%41+b" -> "A b". Malformed escapes stay as they are.
std::string percent_decode(std::string_view text);

}  // namespace vramd::server
