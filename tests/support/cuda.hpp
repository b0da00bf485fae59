// For a [cuda] case: whether a CUDA device is here. Where none is, the case says it skipped (a
// warning scripts/gpu-check lists) or, with VRAMD_REQUIRE_CUDA=1, fails. Include it after Catch.
#pragma once

#include <ATen/Context.h>

#include <cstdlib>
#include <string>

#include "util/torch_cuda.hpp"

namespace vramd::test {

inline bool cuda_device_here() {
  if (vramd::torch_cuda::missing().empty() && at::hasCUDA()) return true;
  if (const char* require = std::getenv("VRAMD_REQUIRE_CUDA"); require && std::string(require) == "1")
    FAIL("no CUDA device here, and VRAMD_REQUIRE_CUDA=1 says one must run this");
  WARN("skipped: no CUDA device here (" << vramd::torch_cuda::missing() << "); scripts/gpu-check runs it on one");
  return false;
}

}  // namespace vramd::test
