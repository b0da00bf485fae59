// LibTorch's CUDA half, loaded only where a GPU can be used.
//
// libtorch_cuda.so holds LibTorch's CUDA kernels, caching allocator and hooks, and pulls in
// cuBLAS, cuBLASLt, cuFFT, cuSPARSE and NVRTC: linked into a process, it costs about 250 MiB of
// memory and 0.2 s at every start, GPU or not (an idle vramd held 371 MB against 116 MB without
// it). vramd links LibTorch's CPU half only and opens the CUDA half at start where a CUDA driver
// is. LibTorch-free.
#pragma once

#include <string>

namespace vramd::torch_cuda {

// Opens libtorch_cuda.so (beside the libtorch_cpu.so this process runs) where a CUDA driver
// (libcuda.so.1) can be opened; once, later calls do nothing. Call it before the process's first
// LibTorch call and before it starts threads: ATen looks its CUDA hooks up once, and a process
// that asked before the library was open has no CUDA for good.
void load();

// Empty where CUDA devices can be used here, else why not: no CUDA driver, a LibTorch without
// CUDA libraries, or load() not called.
const std::string& missing();

// Opens libtorch_cuda.so whatever the driver (what load() does where there is one), registering
// LibTorch's CUDA kernels. Throws Error naming the file when it cannot. For tests.
void open_libraries();

}  // namespace vramd::torch_cuda
