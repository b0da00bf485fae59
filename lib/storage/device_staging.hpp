// Checkpoint bytes into tensors on a device at the disk's speed: several reads in flight
// (storage::read_staged) into pinned host buffers that are reused, and each chunk's copy to the
// device queued as soon as the chunk lands, so that reading the next chunks overlaps copying
// the last ones. Host memory that is not pinned crosses the same way (copy()). On the CPU the
// buffers are plain memory and each copy is made at once (a CPU tensor is better read into
// directly, with DiskMap::read_ranges: this serves tests there).
//
// The buffers are huge pages wherever the kernel has them: an O_DIRECT read into 4 KiB pages
// needs a segment per page, and a virtual disk (254 segments a request) can then read several
// times slower (docs/benchmarks.md: from 1.1x to 5.7x on the development VM). On a GPU they
// are registered with the CUDA driver to be pinned (util/cuda_vmm.hpp's HostRegistration), as
// LibTorch's pinned memory (cudaHostAlloc) has 4 KiB pages; and kept for the next
// DeviceStaging once this one goes (up to four), as LibTorch keeps its own: page-locking memory
// is ordered against every stream of the device.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "storage/disk_map.hpp"

namespace vramd::storage {

class DeviceStaging {
 public:
  // 16 reads of 8 MiB in flight: what NVMe drives want to give their speed (bench/stream.py's
  // read bound is measured so).
  static constexpr unsigned kBuffers = 16;
  static constexpr uint64_t kBufferBytes = 8u << 20;

  // What a GPU's buffers are: huge pages registered with the driver, or LibTorch's pinned
  // memory (what a refused registration falls back to, saying so in the log; and what
  // bench/storage compares against). On the CPU, huge pages either way.
  enum class HostMemory { Registered, TorchPinned };

  // The buffers are allocated on first use, and kept until this goes.
  explicit DeviceStaging(c10::Device device, unsigned buffers = kBuffers, uint64_t buffer_bytes = kBufferBytes,
                         HostMemory memory = HostMemory::Registered);
  ~DeviceStaging();  // waits for the copies still queued out of its buffers
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // Bytes [offset, offset + out.nbytes()) of the map's files()[file] into `out`, a contiguous
  // tensor on the device.
  struct Target {
    uint32_t file;
    uint64_t offset;
    at::Tensor out;
  };
  // Fills every target. The copies are queued on the calling thread's current stream of the
  // device, so ops queued on it after this see the bytes; the host sees them once that stream
  // is synchronised. Throws as DiskMap::read_staged does (ReadFailure naming the file); then
  // what the targets hold is undefined. One read at a time.
  void read(const DiskMap& map, std::span<const Target> targets, bool direct);

  // `bytes`, host memory of any kind (a memfd's or a checkpoint's mapping, which the device
  // copies several times slower than pinned memory), into `out`, a contiguous tensor on the
  // device of as many bytes.
  struct HostCopy {
    std::span<const std::byte> bytes;
    at::Tensor out;
  };
  // Copies every one through the buffers: each chunk copied on this thread into a free buffer
  // while the device copies the ones before out of theirs, queued and seen as read()'s are.
  // On the CPU, each chunk is copied at once. One copy or read at a time.
  void copy(std::span<const HostCopy> copies);

  uint64_t host_bytes() const;  // the pinned host memory its buffers hold (0 before the first read)
  // What that memory is: "huge pages registered with the CUDA driver", "LibTorch's pinned
  // memory", "huge pages" (on the CPU), or "none" before the first read.
  std::string host_memory() const;

 private:
  class Pool;
  Pool& pool();  // made on first use
  at::Tensor target_bytes(const at::Tensor& out, const char* what) const;  // out's bytes, once checked
  c10::Device device_;
  unsigned buffers_;
  uint64_t buffer_bytes_;
  HostMemory memory_;
  std::unique_ptr<Pool> pool_;
};

}  // namespace vramd::storage
