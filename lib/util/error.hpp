// Errors thrown inside vramd. Each stage adds its context in front ("config.toml: ..."), and
// one boundary (a CLI command, a request) turns the message into a status.
#pragma once

#include <stdexcept>
#include <string>

namespace vramd {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws Error("<context>: <message>").
[[noreturn]] inline void fail(const std::string& context, const std::string& message) {
  throw Error(context.empty() ? message : context + ": " + message);
}

}  // namespace vramd
