// The one boundary of every callback the event loop or a worker thread runs: whatever the
// work throws is caught here, logged naming where it happened, and handed back as text, so that
// nothing from a request, a file or a model ends the process through std::terminate.
#pragma once

#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "util/log.hpp"

namespace vramd::server {

// Runs `work`; returns nullopt when it returned, or the message of what it threw. `where` is
// text, or a function that makes it, called only when something was thrown (for callbacks on
// every request or read, which should not build a string each time).
template <typename Where, typename Work>
std::optional<std::string> guarded(const Where& where, Work&& work) noexcept {
  std::string message;
  try {
    work();
    return std::nullopt;
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "an exception that is not a std::exception";
  }
  try {
    if constexpr (std::is_invocable_v<const Where&>) log::error("internal error in " + where() + ": " + message);
    else log::error("internal error in " + std::string(where) + ": " + message);
  } catch (...) {  // out of memory even for the log line: the message is still returned
  }
  return message;
}

}  // namespace vramd::server
