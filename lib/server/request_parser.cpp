#include "server/request_parser.hpp"

#include <algorithm>
#include <cctype>
#include <sstream>

namespace vramd::server {

const std::string* Request::header(std::string_view name) const {
  for (const auto& [key, value] : headers)
    if (key == name) return &value;
  return nullptr;
}

std::string percent_decode(std::string_view text) {
  const auto hex = [](char c) { return std::isdigit(static_cast<unsigned char>(c)) ? c - '0' : (c | 0x20) - 'a' + 10; };
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '+') {
      out += ' ';
    } else if (text[i] == '%' && i + 2 < text.size() && std::isxdigit(static_cast<unsigned char>(text[i + 1])) &&
               std::isxdigit(static_cast<unsigned char>(text[i + 2]))) {
      out += static_cast<char>(hex(text[i + 1]) * 16 + hex(text[i + 2]));
      i += 2;
    } else {
      out += text[i];
    }
  }
  return out;
}

namespace {

RequestParser* of(http_parser* parser) { return static_cast<RequestParser*>(parser->data); }

}  // namespace

RequestParser::RequestParser(RequestLimits limits) : limits_(limits) {
  http_parser_init(&parser_, HTTP_REQUEST);
  parser_.data = this;
}

RequestParser::Step RequestParser::feed(const char* data, size_t size) {
  began_ = wants_continue_ = false;
  Step step;
  step.consumed = http_parser_execute(&parser_, &settings(), data, size);
  step.began = began_;
  step.wants_continue = wants_continue_;
  const auto error = HTTP_PARSER_ERRNO(&parser_);
  if (error == HPE_PAUSED) {
    step.result = Result::Complete;
  } else if (error != HPE_OK) {
    if (!refusal_status_) {
      if (error == HPE_HEADER_OVERFLOW) refuse(431, "request headers exceed " + std::to_string(HTTP_MAX_HEADER_SIZE) + " bytes, http-parser's own bound");
      else refuse(400, std::string("malformed HTTP request: ") + http_errno_description(error));
    }
    step.result = Result::Refused;
  }
  return step;
}

Request RequestParser::take() {
  http_parser_pause(&parser_, 0);
  return std::move(request_);
}

void RequestParser::refuse(int status, std::string message) {
  refusal_status_ = status;
  refusal_ = std::move(message);
}

bool RequestParser::count_header_bytes(size_t n) {
  header_bytes_ += n;
  if (header_bytes_ <= limits_.max_header_bytes) return true;
  refuse(431, "request line and headers exceed " + std::to_string(limits_.max_header_bytes) +
                   " bytes ([limits] max_header_size in the daemon config)");
  return false;
}

const http_parser_settings& RequestParser::settings() {
  static const http_parser_settings s = [] {
    http_parser_settings s{};
    s.on_message_begin = [](http_parser* parser) {
      auto* self = of(parser);
      self->request_ = Request{};
      self->request_.headers.reserve(8);  // one allocation for a request's few headers
      self->url_.clear();
      self->header_bytes_ = 0;
      self->last_was_value_ = false;
      self->receiving_ = self->began_ = true;
      return 0;
    };
    s.on_url = [](http_parser* parser, const char* at, size_t length) {
      auto* self = of(parser);
      self->url_.append(at, length);
      return self->count_header_bytes(length) ? 0 : 1;
    };
    s.on_header_field = [](http_parser* parser, const char* at, size_t length) {
      auto* self = of(parser);
      if (self->last_was_value_ || self->request_.headers.empty()) self->request_.headers.emplace_back();
      self->last_was_value_ = false;
      auto& name = self->request_.headers.back().first;
      for (size_t i = 0; i < length; ++i) name += static_cast<char>(std::tolower(static_cast<unsigned char>(at[i])));
      return self->count_header_bytes(length) ? 0 : 1;
    };
    s.on_header_value = [](http_parser* parser, const char* at, size_t length) {
      auto* self = of(parser);
      if (self->request_.headers.empty()) self->request_.headers.emplace_back();
      self->last_was_value_ = true;
      self->request_.headers.back().second.append(at, length);
      return self->count_header_bytes(length) ? 0 : 1;
    };
    s.on_headers_complete = [](http_parser* parser) {
      auto* self = of(parser);
      const uint64_t max = self->limits_.max_body_bytes;
      if ((parser->flags & F_CONTENTLENGTH) && parser->content_length > max) {
        self->refuse(413, "request body of " + std::to_string(parser->content_length) + " bytes exceeds the limit of " +
                              std::to_string(max) + " bytes");
        return -1;
      }
      const std::string url = std::move(self->url_);
      const auto question = url.find('?');
      Request& request = self->request_;
      request.method = http_method_str(static_cast<http_method>(parser->method));
      request.path = percent_decode(std::string_view(url).substr(0, question));
      if (question != std::string::npos) {
        std::istringstream pairs(url.substr(question + 1));
        for (std::string pair; std::getline(pairs, pair, '&');) {
          const auto equals = pair.find('=');
          request.query[percent_decode(pair.substr(0, equals))] =
              equals == std::string::npos ? "" : percent_decode(pair.substr(equals + 1));
        }
      }
      const std::string* expect = request.header("expect");
      self->wants_continue_ = expect && (*expect == "100-continue" || *expect == "100-Continue");
      return 0;
    };
    s.on_body = [](http_parser* parser, const char* at, size_t length) {
      auto* self = of(parser);
      auto& body = self->request_.body;
      if (body.size() + length > self->limits_.max_body_bytes) {
        self->refuse(413, "request body exceeds the limit of " + std::to_string(self->limits_.max_body_bytes) + " bytes");
        return -1;
      }
      // Room for what the client announced, in steps: a Content-Length alone reserves no gigabytes.
      if ((parser->flags & F_CONTENTLENGTH) && body.capacity() < body.size() + length)
        body.reserve(std::min<uint64_t>(body.size() + length + parser->content_length, 2 * body.size() + (64 << 20)));
      body.append(at, length);
      return 0;
    };
    s.on_message_complete = [](http_parser* parser) {
      auto* self = of(parser);
      self->receiving_ = false;
      self->keep_alive_ = http_should_keep_alive(parser) != 0;
      http_parser_pause(parser, 1);
      return 0;
    };
    return s;
  }();
  return s;
}

}  // namespace vramd::server
