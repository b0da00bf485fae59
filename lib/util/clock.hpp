// Elapsed time on the monotonic clock, for the figures vramd reports.
#pragma once

#include <chrono>

namespace vramd {

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace vramd
