// What loading and moving weights report to their callers, without LibTorch: the daemon's
// registry and runtime hand these across the wall (lib/CMakeLists.txt) without including the
// loader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "util/error.hpp"

namespace vramd::model {

struct Progress {
  std::string_view tensor;  // the parameter just loaded
  uint64_t bytes_done = 0, bytes_total = 0;
  size_t tensors_done = 0, tensors_total = 0;
};

// A load stopped because its progress callback returned false.
class Cancelled : public Error {
 public:
  using Error::Error;
};

struct Transition {
  uint64_t bytes = 0;  // of weights moved, read or released
  double seconds = 0;
};

}  // namespace vramd::model
