#include "util/cuda_vmm.hpp"

#include <dlfcn.h>

#include <catch2/catch.hpp>

using Catch::Matchers::Contains;
using vramd::cuda::HostRegistration;
using vramd::cuda::VmmRegion;

TEST_CASE("Without a CUDA driver, GPU regions and host registrations are refused saying why", "[cuda]") {
  alignas(4096) static char page[4096];
  if (!vramd::cuda::built_with_cuda_h()) {
    REQUIRE_THROWS_WITH(VmmRegion::create(0, 1 << 20), Contains("built without CUDA's cuda.h"));
    REQUIRE_THROWS_WITH(HostRegistration(0, page, sizeof page), Contains("built without CUDA's cuda.h"));
    return;
  }
  if (void* driver = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
    ::dlclose(driver);
    WARN("skipped: a CUDA driver is here, and tests/client/test_lease_cuda.py makes and maps regions with it");
    return;
  }
  REQUIRE_THROWS_WITH(VmmRegion::create(0, 1 << 20), Contains("no CUDA driver here (libcuda.so.1"));
  REQUIRE_THROWS_WITH(VmmRegion::import(0, 0, 1 << 20, true), Contains("no CUDA driver here"));
  REQUIRE_THROWS_WITH(HostRegistration(0, page, sizeof page), Contains("no CUDA driver here"));
}
