#include "util/torch_cuda.hpp"

#include <dlfcn.h>
#include <linux/limits.h>

#include <mutex>

#include "util/cuda_vmm.hpp"
#include "util/error.hpp"

namespace vramd::torch_cuda {

namespace {

std::string why_not = "LibTorch's CUDA libraries were not loaded (vramd::torch_cuda::load was not called)";
std::once_flag loaded;

std::string dl_error() {
  const char* why = ::dlerror();
  return why ? why : "unknown error";
}

}  // namespace

void open_libraries() {
  // The folder of the libtorch_cpu.so already loaded, so the CUDA half matches it.
  void* cpu = ::dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
  if (!cpu) throw Error("LibTorch's libtorch_cpu.so is not loaded in this process: " + dl_error());
  char folder[PATH_MAX] = {};
  const int found = ::dlinfo(cpu, RTLD_DI_ORIGIN, folder);
  ::dlclose(cpu);
  if (found != 0) throw Error("cannot find the folder of LibTorch's libtorch_cpu.so: " + dl_error());
  const std::string path = std::string(folder) + "/libtorch_cuda.so";
  // Global, as when linked: its kernels and hooks register themselves as it opens. Never closed.
  if (!::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL))
    throw Error("this LibTorch has no usable CUDA libraries (" + dl_error() + ")");
}

void load() {
  std::call_once(loaded, [] {
    try {
      cuda::open_driver();
      open_libraries();
      why_not.clear();
    } catch (const Error& e) {
      why_not = e.what();
    }
  });
}

const std::string& missing() { return why_not; }

}  // namespace vramd::torch_cuda
