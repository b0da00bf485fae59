// GPU memory that another process can map: one allocation made with the CUDA driver's virtual
// memory API (cuMemCreate), exportable as a POSIX file descriptor, mapped at an address of this
// process in the device's primary context (the one PyTorch computes in). The daemon creates
// regions and hands their descriptors over a lease's connection; a client imports one and maps
// it read-only where the driver allows. Also host memory registered with the driver, for
// staging buffers the device copies from.
//
// The driver (libcuda.so.1) is opened at run time, so vramd builds and runs where there is none;
// cuda.h comes from the CUDA toolkit or the torch wheel's nvidia packages at build time. A vramd
// built without cuda.h, or running without a driver, throws Error saying which. LibTorch-free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "util/unique_fd.hpp"

namespace vramd::cuda {

class VmmRegion {
 public:
  // At least `size` bytes (rounded up to the allocation granularity) on device `device`,
  // readable and writable here. Throws Error when the driver is missing or refuses.
  static std::shared_ptr<VmmRegion> create(int device, uint64_t size);
  // The allocation behind `fd` (a descriptor from export_fd() of another process; not taken
  // over), `size` bytes of it mapped on `device`: read-only when `read_only` and the driver
  // allows it (read_only() tells), else readable and writable.
  static std::shared_ptr<VmmRegion> import(int device, int fd, uint64_t size, bool read_only);
  ~VmmRegion();
  VmmRegion(const VmmRegion&) = delete;
  VmmRegion& operator=(const VmmRegion&) = delete;

  std::byte* data() const { return reinterpret_cast<std::byte*>(address_); }
  uint64_t size() const { return size_; }
  int device() const { return device_; }
  bool read_only() const { return read_only_; }
  bool contains(const void* p) const { return p >= data() && p < data() + size_; }
  // The allocation's descriptor, exported once (the region keeps it; duplicate it to hand over).
  int fd() const { return fd_.get(); }

 private:
  VmmRegion() = default;
  uint64_t handle_ = 0;   // CUmemGenericAllocationHandle
  uint64_t address_ = 0;  // CUdeviceptr
  uint64_t size_ = 0;
  int device_ = 0;
  bool mapped_ = false;
  bool read_only_ = false;
  UniqueFd fd_;
};

// Host memory the device copies from as from pinned memory (the copies run asynchronously, at the
// bus's speed): [address, address + size) page-locked and registered with the CUDA driver
// (cuMemHostRegister, portable to every context) for as long as this lives. What
// cudaHostAlloc gives is 4 KiB pages; registering lets the caller choose the pages, huge ones
// for O_DIRECT reads. `read_only`: the pages are mapped read-only (a client's memfd), so the
// device only reads them (CU_MEMHOSTREGISTER_READ_ONLY). Throws Error when the driver is
// missing or refuses.
class HostRegistration {
 public:
  HostRegistration(int device, void* address, uint64_t size, bool read_only = false);
  ~HostRegistration();
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

 private:
  int device_;
  void* address_;
};

// Whether this build can make CUDA regions at all (it found cuda.h); false says leases of CUDA
// memory are refused here whatever the machine has.
bool built_with_cuda_h();

// The CUDA driver, libcuda.so.1, opened (not initialised). Throws Error("no CUDA driver here
// (<why>)") where it cannot be opened.
void* open_driver();

}  // namespace vramd::cuda
