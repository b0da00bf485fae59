#include "util/torch_cuda.hpp"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <spawn.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <string>

#include "config/daemon_config.hpp"
#include "weights/source.hpp"

extern char** environ;

using Catch::Matchers::Contains;
namespace torch_cuda = vramd::torch_cuda;

namespace {

bool mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.find(library) != std::string::npos) return true;
  return false;
}

bool has_cuda_kernel() {
  const auto op = c10::Dispatcher::singleton().findSchema({"aten::empty", "memory_format"});
  REQUIRE(op);
  return op->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

}  // namespace

TEST_CASE("LibTorch's CUDA half is opened only where a CUDA driver is", "[cuda]") {
  if (torch_cuda::missing().empty()) {
    CHECK(mapped("/libtorch_cuda.so"));
    CHECK(has_cuda_kernel());
    WARN("skipped: a CUDA driver is here, LibTorch's CUDA half was opened at start and the GPU check computes on it");
    return;
  }
  REQUIRE_THAT(torch_cuda::missing(), Contains("no CUDA driver here (libcuda.so.1"));
  CHECK_FALSE(mapped("/libtorch_cuda.so"));
  CHECK_FALSE(mapped("/libcublasLt.so"));
  CHECK_FALSE(has_cuda_kernel());
  // A model's CUDA device is refused with the reason, not with an error from deep in ATen.
  REQUIRE_THROWS_WITH(vramd::weights::torch_device(*vramd::config::Device::parse("cuda:0")),
                      Contains("cuda:0: no CUDA driver here (libcuda.so.1"));

  // Opening it registers LibTorch's CUDA kernels and hooks. In a fresh process of this binary:
  // ATen asks for its CUDA hooks once, so only a process that has asked nothing yet shows them.
  const char* argv[] = {"vramd_tests", "[torch_cuda_opened]", "-w", "NoTests", nullptr};
  pid_t child = 0;
  REQUIRE(posix_spawn(&child, "/proc/self/exe", nullptr, nullptr, const_cast<char**>(argv), environ) == 0);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("Opened, LibTorch's CUDA half registers its kernels and hooks", "[.][torch_cuda_opened]") {
  torch_cuda::open_libraries();
  CHECK(mapped("/libtorch_cuda.so"));
  CHECK(has_cuda_kernel());
  CHECK(at::detail::getCUDAHooks().hasCUDART());
}
