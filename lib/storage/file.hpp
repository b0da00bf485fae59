// A read-only checkpoint file: positioned reads, a descriptor for O_DIRECT reads of cold data
// (storage::read_ranges), and a lazy copy-on-write mapping for zero-copy views. Safe to use from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>

#include "util/error.hpp"

namespace vramd::storage {

// A read of a checkpoint that failed: an I/O error, or a file cut short while in use. The
// machine's fault or the files', never the request's (a forward answers it with a 500).
class ReadFailure : public Error {
 public:
  using Error::Error;
};

class File {
 public:
  static constexpr size_t kDirectAlignment = 4096;  // of offsets, sizes and buffers for O_DIRECT
  static constexpr uint64_t align_down(uint64_t n) { return n & ~uint64_t{kDirectAlignment - 1}; }
  static constexpr uint64_t align_up(uint64_t n) { return align_down(n + kDirectAlignment - 1); }

  explicit File(std::string path);  // throws Error naming the path
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }

  // Reads exactly dst.size() bytes at `offset` through the page cache.
  void read(std::span<std::byte> dst, uint64_t offset) const;

  // A descriptor of the file opened with O_DIRECT (on first use), or -1 where the file system
  // refuses that (tmpfs, for one).
  int direct_fd() const;

  // The whole file, mapped privately on first use; writes to it never reach the file.
  std::span<std::byte> mapping() const;

  // Bytes [offset, offset + n) in a read-only mapping made for them alone: nothing copied.
  // Read-ahead of the pages not cached yet starts now (MADV_WILLNEED); pages are mapped as they
  // are first touched. Returns the mapping's start and length, for munmap; the bytes begin
  // offset % page size into it. Throws Error naming the path when the file no longer holds them
  // (a file truncated while mapped faults on access, as any mapping does).
  std::pair<void*, size_t> map_range(uint64_t offset, uint64_t n) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  mutable std::once_flag map_once_;
  mutable std::byte* map_ = nullptr;
  mutable std::once_flag direct_once_;
  mutable int direct_fd_ = -1;
};

}  // namespace vramd::storage
