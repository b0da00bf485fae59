# Imports LibTorch from the pinned `torch` wheel as the target vramd::torch.
#
# We import the shared libraries directly instead of calling find_package(Torch): TorchConfig
# insists on a CUDA toolkit matching the wheel's, and we compile no CUDA sources of our own.
# libtorch_cuda is not linked: util/torch_cuda.cpp opens it at start where a CUDA driver is, so
# that a process without a GPU does not carry cuBLAS, cuFFT and NVRTC (about 250 MiB).
#
# TORCH_CMAKE_PREFIX is torch.utils.cmake_prefix_path (scripts/setup passes it).
if(NOT TORCH_CMAKE_PREFIX)
  message(FATAL_ERROR "Set TORCH_CMAKE_PREFIX to torch.utils.cmake_prefix_path (scripts/setup does)")
endif()
get_filename_component(TORCH_ROOT "${TORCH_CMAKE_PREFIX}/../.." ABSOLUTE)
set(TORCH_LIB_DIR "${TORCH_ROOT}/lib")
if(NOT EXISTS "${TORCH_LIB_DIR}/libtorch_cpu.so")
  message(FATAL_ERROR "No libtorch_cpu.so under ${TORCH_LIB_DIR}")
endif()

add_library(vramd_torch INTERFACE)
add_library(vramd::torch ALIAS vramd_torch)
target_include_directories(vramd_torch SYSTEM INTERFACE
  "${TORCH_ROOT}/include" "${TORCH_ROOT}/include/torch/csrc/api/include")
target_compile_definitions(vramd_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=1)
set(_torch_libs "${TORCH_LIB_DIR}/libtorch_cpu.so" "${TORCH_LIB_DIR}/libc10.so")
if(EXISTS "${TORCH_LIB_DIR}/libtorch_cuda.so")
  set(VRAMD_TORCH_HAS_CUDA ON)
endif()
# Every executable that links LibTorch exports none of its own symbols (torch_executable.map).
# The wheel's LibTorch is built by another toolchain, against another libstdc++, than ours; where
# our executable exported its instances of libstdc++'s templates, LibTorch and libstdc++ bound to
# them: a known cause of aborts at exit (pytorch/pytorch#30507), and the suspect in the one every
# torch-linked process of ours met on a lent H200 (Ubuntu 24.04, GCC 13; docs/benchmarks.md),
# which Python, exporting no C++, never met. tests/build/exports.cmake checks the executables.
target_link_libraries(vramd_torch INTERFACE
  "-Wl,--no-as-needed" ${_torch_libs} "-Wl,--as-needed"
  "-Wl,-rpath,${TORCH_LIB_DIR}" "-Wl,--allow-shlib-undefined"
  "-Wl,--version-script=${CMAKE_CURRENT_LIST_DIR}/torch_executable.map")
message(STATUS "LibTorch: ${TORCH_ROOT} (CUDA libraries, opened at run time where a driver is: ${VRAMD_TORCH_HAS_CUDA})")
