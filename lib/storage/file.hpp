// A read-only checkpoint file: positioned reads, a descriptor for O_DIRECT reads of cold data
// (storage::read_ranges), and mappings for zero-copy views (storage/mapping.hpp). Safe to use
// from several threads at once.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>

#include "storage/mapping.hpp"
#include "util/error.hpp"

namespace vramd::storage {

// A read of a checkpoint that failed: an I/O error, or a file cut short while in use. The
// machine's fault or the files', never the request's (a forward answers it with a 500).
class ReadFailure : public Error {
 public:
  using Error::Error;
};

// A mapping of the file lost pages: it was cut short while mapped, and what was read through
// the mapping since holds zeros. Whatever holds such reads (a model's weights) is to be read
// again once the file is whole.
class MappingLost : public ReadFailure {
 public:
  using ReadFailure::ReadFailure;
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

  // Takes the pages of mapping() out of this process, but those of the ranges `keep` ([begin,
  // end) offsets, sorted): bytes read through it to be copied (converted, cast) and held by
  // nothing since. They stay in the page cache, clean, for whoever reads them next; a later read
  // through the mapping maps them again. Nothing to do where the file was never mapped.
  void unmap_pages_except(std::span<const std::pair<uint64_t, uint64_t>> keep) const;

  // Bytes [offset, offset + n) in a read-only mapping made for them alone: nothing copied.
  // Read-ahead of the pages not cached yet starts now (MADV_WILLNEED); pages are mapped as they
  // are first touched. The bytes begin offset % page size into the mapping. Throws ReadFailure
  // naming the path when the file no longer holds them.
  std::unique_ptr<Mapping> map_range(uint64_t offset, uint64_t n) const;

  // Throws MappingLost naming the file when one of its mappings lost pages since it was
  // opened (storage::survive_cut_files). To be called after reading through them.
  void check_mappings() const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  std::shared_ptr<std::atomic<bool>> lost_ = std::make_shared<std::atomic<bool>>(false);
  mutable std::once_flag map_once_;
  mutable std::unique_ptr<Mapping> map_;
  mutable std::atomic<bool> mapped_{false};  // map_ is made
  mutable std::once_flag direct_once_;
  mutable int direct_fd_ = -1;
};

}  // namespace vramd::storage
