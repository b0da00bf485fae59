// Checkpoint bytes mapped into memory, and what becomes of a read of a mapped page whose file
// was cut short meanwhile. Such a read faults with SIGBUS, which kills any process by default.
// Once survive_cut_files() is called, it reads zeros instead and marks the mapping's file as
// lost; whoever read through the mapping must then check the mark (File::check_mappings) and
// throw, so that no answer computed from those zeros leaves the process.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace vramd::storage {

// Process-wide and for good: SIGBUS on a Mapping's page reads zeros and sets its `lost` mark.
// Faults anywhere else go on to the handler that was there before (the default kills). The
// daemon turns it on; tools that do not check their mappings leave it off.
void survive_cut_files();

class Mapping {
 public:
  // Maps `length` bytes of `fd` from `offset` (a multiple of the page size): shared and
  // read-only, or private and writable (writes never reach the file). `lost` is set when a
  // page of it is lost. Throws ReadFailure naming `path`.
  Mapping(const std::string& path, int fd, uint64_t offset, size_t length, bool writable,
          std::shared_ptr<std::atomic<bool>> lost);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t slot_ = 0;  // in the table the SIGBUS handler reads
  std::shared_ptr<std::atomic<bool>> lost_;
};

}  // namespace vramd::storage
