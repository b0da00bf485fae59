// Reads many byte ranges of checkpoint files with several requests in flight, so that a disk
// gives its speed: NVMe drives reach it only with many requests queued, and one positioned
// read at a time leaves most of it unused. O_DIRECT reads go through io_uring (a few large
// aligned requests in flight, each straight into the caller's memory where the alignment
// allows); where the kernel refuses io_uring (seccomp, io_uring_disabled), and for reads
// through the page cache, through a few threads of positioned reads instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace vramd::storage {

class File;

struct ReadRange {
  const File* file;
  uint64_t offset;           // in the file
  std::span<std::byte> dst;  // receives exactly dst.size() bytes
};

struct ReaderOptions {
  bool direct = false;             // O_DIRECT, where the file system allows it (else the page cache)
  unsigned depth = 16;             // requests in flight
  uint64_t block = 8u << 20;       // bytes per request at most
  enum class Engine { Auto, Uring, Threads } engine = Engine::Auto;  // Auto: io_uring for direct reads
};

// Fills every range. On failure throws ReadFailure (storage/file.hpp) naming the file, the offset and the cause (the
// first read that failed; a file shorter than a range is "unexpected end of file"), and only
// after every request in flight has finished: no buffer is written once this returns.
//
// Direct reads land in dst itself wherever dst's address and the offset agree modulo 4096
// (model::fresh_buffer's `phase` arranges that); the unaligned first and last bytes of a range,
// and ranges that do not agree, go through small aligned bounce buffers.
void read_ranges(std::span<const ReadRange> ranges, const ReaderOptions& options = {});

// Whether io_uring can be used by this process (tried once).
bool io_uring_available();

}  // namespace vramd::storage
