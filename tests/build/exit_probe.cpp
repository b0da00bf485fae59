// The smallest process that links LibTorch as vramd's executables do (vramd::torch: the same
// libraries, flags and export map) and nothing else of ours but the loader of LibTorch's CUDA
// half. It must exit 0. On the first GPU machine lent, every process of ours that links LibTorch
// aborted at exit in LibTorch's static destructors; scripts/gpu-check runs this probe beside
// vramd_tests when that dies, to tell which part of a process it takes.
//
//   vramd_exit_probe             LibTorch linked, nothing opened
//   vramd_exit_probe driver      LibTorch's CUDA half opened where a CUDA driver is, as ours do
//   vramd_exit_probe libraries   LibTorch's CUDA half opened whatever the driver
#include <cstdio>
#include <string_view>

#include "util/error.hpp"
#include "util/torch_cuda.hpp"

int main(int argc, char** argv) {
  const std::string_view mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "driver") {
      vramd::torch_cuda::load();
      const std::string& missing = vramd::torch_cuda::missing();
      std::printf("%s\n", missing.empty() ? "LibTorch's CUDA half is open" : missing.c_str());
    } else if (mode == "libraries") {
      vramd::torch_cuda::open_libraries();
      std::printf("LibTorch's CUDA half is open\n");
    } else if (!mode.empty()) {
      std::fprintf(stderr, "usage: vramd_exit_probe [driver|libraries]\n");
      return 2;
    }
  } catch (const vramd::Error& e) {
    std::fprintf(stderr, "vramd_exit_probe: %s\n", e.what());
    return 1;
  }
  return 0;
}
