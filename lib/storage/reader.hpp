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

// A range read through staging buffers rather than into memory of the caller's own: its bytes
// land, a chunk at a time, in buffers the caller lends (pinned host memory that a device copies
// from), and the caller takes each chunk away as soon as it has landed.
struct StagedRange {
  const File* file;
  uint64_t offset;  // in the file
  uint64_t size;
};

// A chunk of a StagedRange that has landed: `bytes` of the range from `at` on, in buffer `buffer`.
struct LandedChunk {
  size_t range;  // index in the ranges read
  uint64_t at;
  std::span<const std::byte> bytes;
  unsigned buffer;
};

// The buffers a staged read lends, and what becomes of a chunk once it has landed.
class StagingPool {
 public:
  virtual ~StagingPool() = default;
  // How many buffers there are, and buffer i: its address aligned to File::kDirectAlignment,
  // its size a multiple of it, the same on every call.
  virtual unsigned count() const = 0;
  virtual std::span<std::byte> buffer(unsigned i) = 0;
  // Takes a chunk that has landed: typically queues its copy out of the buffer. Until done(i)
  // says that copy is over (or wait(i) returns) nothing is read into that buffer again.
  virtual void take(const LandedChunk& chunk) = 0;
  virtual bool done(unsigned i) = 0;
  virtual void wait(unsigned i) = 0;
};

// Reads every range through the pool's buffers in chunks of at most a buffer's size, with up
// to options.depth reads in flight (no more than the pool has buffers), handing each chunk to
// pool.take as soon as it has landed, in no set order. take is called from one thread at a
// time (with the threads engine, not always the calling one). Throws as read_ranges does, and
// rethrows what take throws, in both cases only after every read in flight has finished: no
// buffer is written once this returns. After a failure no chunk is taken; those taken before
// stay taken (their copies are the pool's to wait for).
void read_staged(std::span<const StagedRange> ranges, StagingPool& pool, const ReaderOptions& options = {});

// Whether io_uring can be used by this process (tried once).
bool io_uring_available();

}  // namespace vramd::storage
