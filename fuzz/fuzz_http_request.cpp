// libFuzzer target: any bytes a client sends parse into requests or one refusal; every request
// routes to an endpoint or a refusal whose text is valid UTF-8; query values decode, and the
// JSON answer built from any of it serialises without an exception.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "config/units.hpp"
#include "server/reply.hpp"
#include "server/request_parser.hpp"
#include "server/routes.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

using namespace vramd;

namespace {

void answer(const server::Request& request) {
  const server::Route route = server::route(request);
  if (!valid_utf8(route.error) || route.endpoint.empty()) std::abort();
  if (route.kind == server::Route::Kind::Refused && (route.status != 404 && route.status != 405)) std::abort();
  nlohmann::json body = {{"error", route.error}, {"path", request.path}, {"model", route.model}};
  if (auto it = request.query.find("keep_alive"); it != request.query.end()) {
    try {
      config::parse_duration(it->second);
    } catch (const Error& e) {
      body["keep_alive"] = "keep_alive=" + escape_invalid_utf8(it->second) + ": " + e.what();
    }
  }
  for (const auto& [name, value] : request.headers) body["headers"][name] = value;
  const std::string text = server::json_line(body);
  if (text.empty() || !valid_utf8(text)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  server::RequestParser parser({1024, 4096});
  const char* at = reinterpret_cast<const char*>(data);
  // Fed in two pieces, as reads split them, then request after request as a pipelining client's.
  const size_t first = size / 3;
  size_t offset = 0;
  for (int steps = 0; offset < size && steps < 1000; ++steps) {
    const size_t piece = offset < first ? first - offset : size - offset;
    const auto step = parser.feed(at + offset, piece);
    if (step.consumed > piece) std::abort();
    offset += step.consumed;
    if (step.result == server::RequestParser::Result::Refused) {
      if (parser.refusal_status() < 400 || !valid_utf8(quote(parser.refusal()))) std::abort();
      return 0;
    }
    if (step.result == server::RequestParser::Result::Complete) answer(parser.take());
    else if (step.consumed == 0 && piece > 0 && offset >= first) break;
  }
  return 0;
}
