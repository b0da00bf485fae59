#include "storage/reader.hpp"

#include <liburing.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "storage/file.hpp"
#include "util/error.hpp"

namespace vramd::storage {
namespace {

constexpr uint64_t kAlign = File::kDirectAlignment;
constexpr uint64_t kBounce = 1u << 20;  // bytes per bounced read

struct FreeAligned {
  void operator()(std::byte* p) const { std::free(p); }
};

// One request: `size` bytes of the file at `offset` into `dst`, of which the first `need` must
// be read (past them lies only the padding of an aligned read at the end of the file). A
// bounced piece reads into a buffer of its own instead, of which bytes [skip, skip + out_size)
// are then copied to `out`.
struct Piece {
  Piece() = default;
  Piece(const File& file, int fd, bool direct, uint64_t offset, uint64_t size, std::byte* dst)
      : file(&file), fd(fd), direct(direct), offset(offset), size(size), need(size), dst(dst) {}

  const File* file = nullptr;
  int fd = -1;
  bool direct = false;
  uint64_t offset = 0, size = 0, need = 0;
  std::byte* dst = nullptr;
  std::byte* out = nullptr;
  uint64_t skip = 0, out_size = 0;
  uint64_t done = 0;  // bytes read so far
  std::unique_ptr<std::byte, FreeAligned> bounce;

  std::byte* target() const { return out ? bounce.get() : dst; }
};

std::string read_error(const Piece& piece, int error) {
  return "read of " + std::to_string(piece.size - piece.done) + " bytes at offset " +
         std::to_string(piece.offset + piece.done) + " failed: " + std::strerror(error);
}

// The pieces of one range. Direct reads: the part of the range whose bytes dst can take
// straight from aligned requests, and bounced pieces for what is left.
void plan(const ReadRange& range, const ReaderOptions& options, std::vector<Piece>& pieces) {
  const File& file = *range.file;
  const int direct_fd = options.direct ? file.direct_fd() : -1;
  const uint64_t begin = range.offset, end = range.offset + range.dst.size();
  std::byte* const dst = range.dst.data();
  auto add = [&](uint64_t from, uint64_t to, bool direct) {  // straight into dst
    for (uint64_t at = from; at < to; at += options.block)
      pieces.emplace_back(file, direct ? direct_fd : file.fd(), direct, at, std::min(options.block, to - at), dst + (at - begin));
  };
  auto bounce = [&](uint64_t from, uint64_t to) {  // aligned reads covering [from, to), copied out
    for (uint64_t at = File::align_down(from); at < to; at += kBounce) {
      Piece& piece = pieces.emplace_back(file, direct_fd, true, at, std::min(kBounce, File::align_up(to) - at), nullptr);
      piece.skip = std::max(at, from) - at;
      piece.out = dst + (at + piece.skip - begin);
      piece.out_size = std::min(at + piece.size, to) - at - piece.skip;
      piece.need = piece.skip + piece.out_size;
    }
  };
  if (begin == end) return;
  if (direct_fd < 0) return add(begin, end, false);
  const bool agrees = (reinterpret_cast<uintptr_t>(dst) - begin) % kAlign == 0;
  const uint64_t body_begin = File::align_up(begin), body_end = File::align_down(end);
  if (!agrees || body_begin >= body_end) return bounce(begin, end);
  if (begin < body_begin) bounce(begin, body_begin);
  add(body_begin, body_end, true);
  if (body_end < end) bounce(body_end, end);
}

// Accounts for `got` more bytes of the piece. Returns true when it is complete; throws ReadFailure
// at an end of file before the piece's needed bytes.
bool advance(Piece& piece, uint64_t got) {
  if (got == 0)
    throw ReadFailure(piece.file->path() + ": unexpected end of file at offset " +
                      std::to_string(piece.offset + piece.done) + " (was it cut short while in use?)");
  piece.done += got;
  if (piece.done < piece.need) return false;
  if (piece.out) std::memcpy(piece.out, piece.bounce.get() + piece.skip, piece.out_size);
  piece.bounce.reset();
  return true;
}

// The rest of a piece through the page cache, when O_DIRECT is refused on it (EINVAL: a file
// system that takes O_DIRECT opens but not these reads) or has ended on an unaligned count.
void finish_buffered(Piece& piece) {
  const uint64_t from = std::max(piece.done, piece.skip);
  std::byte* out = piece.out ? piece.out + (from - piece.skip) : piece.dst + from;
  const uint64_t to = piece.need;
  if (to > from) piece.file->read({out, to - from}, piece.offset + from);
  piece.bounce.reset();
}

void allocate_bounce(Piece& piece) {
  if (!piece.out || piece.bounce) return;
  piece.bounce.reset(static_cast<std::byte*>(std::aligned_alloc(kAlign, piece.size)));
  if (!piece.bounce)
    throw ReadFailure(piece.file->path() + ": cannot allocate " + std::to_string(piece.size) + " bytes for a direct read");
}

// Takes in what a read of the piece from piece.done returned (bytes, or -errno), from either
// engine. Returns true when the piece is complete, false when it is to be read on.
bool settle(Piece& piece, int64_t result) {
  if (result == -EINTR || result == -EAGAIN) return false;
  if (result == -EINVAL && piece.direct) return finish_buffered(piece), true;
  if (result < 0) throw ReadFailure(piece.file->path() + ": " + read_error(piece, static_cast<int>(-result)));
  if (advance(piece, static_cast<uint64_t>(result))) return true;
  if (piece.direct && piece.done % kAlign) return finish_buffered(piece), true;  // a short read: the end is near
  return false;
}

// One piece with positioned reads, on the calling thread.
void read_piece(Piece& piece) {
  allocate_bounce(piece);
  for (bool complete = false; !complete;) {
    const ssize_t got = ::pread(piece.fd, piece.target() + piece.done, piece.size - piece.done,
                                static_cast<off_t>(piece.offset + piece.done));
    complete = settle(piece, got < 0 ? -errno : got);
  }
}

// What an engine reads: pieces handed out one at a time, each handed back once complete.
class Work {
 public:
  virtual ~Work() = default;
  // The next piece to read, or null when none can start now. When `idle` the caller has nothing
  // else to wait for (io_uring: nothing in flight; a thread: it holds no piece), so the work may
  // block until a piece can start, and null means that nothing is left.
  virtual Piece* next(bool idle) = 0;
  virtual void complete(Piece& piece) = 0;  // may throw: the reads fail with that
};

// read_ranges' work: its pieces, in order.
class PieceList final : public Work {
 public:
  explicit PieceList(std::vector<Piece>& pieces) : pieces_(pieces) {}
  Piece* next(bool) override { return next_ < pieces_.size() ? &pieces_[next_++] : nullptr; }
  void complete(Piece&) override {}

 private:
  std::vector<Piece>& pieces_;
  size_t next_ = 0;
};

// Positioned reads on `threads` threads, the calling one among them. The work is asked and
// told under one lock.
void read_with_threads(Work& work, unsigned threads) {
  std::mutex mutex;
  std::exception_ptr failure;
  auto worker = [&] {
    for (;;) {
      Piece* piece = nullptr;
      try {
        {
          std::lock_guard lock(mutex);
          if (failure || !(piece = work.next(true))) return;  // after a failure, start nothing more
        }
        read_piece(*piece);
        std::lock_guard lock(mutex);
        if (!failure) work.complete(*piece);  // after a failure, what lands is dropped
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!failure) failure = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& thread : pool) thread.join();  // the reads of other threads finish first
  if (failure) std::rethrow_exception(failure);
}

// A ring per thread, made at its first use, as deep as the deepest asked for.
class Ring {
 public:
  static Ring* get(unsigned depth) {
    if (current && current->depth_ >= depth) return current.get();
    current.reset();
    auto made = std::make_unique<Ring>();
    if (io_uring_queue_init(depth, &made->ring_, 0) != 0) return nullptr;
    made->depth_ = depth;
    made->ready_ = true;
    current = std::move(made);
    return current.get();
  }
  static void drop() { current.reset(); }  // with any entries it was never able to submit
  ~Ring() {
    if (ready_) io_uring_queue_exit(&ring_);
  }
  io_uring* get() { return &ring_; }

 private:
  static thread_local std::unique_ptr<Ring> current;
  io_uring ring_{};
  unsigned depth_ = 0;
  bool ready_ = false;
};
thread_local std::unique_ptr<Ring> Ring::current;

void read_with_uring(Work& work, Ring& ring, unsigned depth) {
  std::vector<Piece*> again;  // pieces to read on from where they stopped
  std::exception_ptr failure;
  unsigned in_flight = 0;
  auto failed = [&] {
    if (!failure) failure = std::current_exception();
  };
  for (;;) {
    while (!failure && in_flight < depth) {
      Piece* piece = nullptr;
      try {
        if (again.empty()) piece = work.next(in_flight == 0);
        else piece = again.back(), again.pop_back();
        if (piece) allocate_bounce(*piece);
      } catch (...) {
        failed();
      }
      if (!piece || failure) break;
      io_uring_sqe* sqe = io_uring_get_sqe(ring.get());
      if (!sqe) {
        again.push_back(piece);
        break;
      }
      io_uring_prep_read(sqe, piece->fd, piece->target() + piece->done, static_cast<unsigned>(piece->size - piece->done),
                         piece->offset + piece->done);
      io_uring_sqe_set_data(sqe, piece);
      ++in_flight;
    }
    if (in_flight == 0) break;
    const int submitted = io_uring_submit_and_wait(ring.get(), 1);
    if (submitted < 0 && submitted != -EINTR && submitted != -EAGAIN && submitted != -EBUSY) {
      // The ring refuses work: wait for what the kernel has, then drop the ring with the rest.
      for (unsigned kernel = in_flight - io_uring_sq_ready(ring.get()); kernel > 0; --kernel) {
        io_uring_cqe* cqe = nullptr;
        if (io_uring_wait_cqe(ring.get(), &cqe) == 0) io_uring_cqe_seen(ring.get(), cqe);
      }
      Ring::drop();
      throw ReadFailure(std::string("io_uring submission failed: ") + std::strerror(-submitted));
    }
    io_uring_cqe* cqe = nullptr;
    unsigned head = 0, seen = 0;
    io_uring_for_each_cqe(ring.get(), head, cqe) {
      ++seen;
      --in_flight;
      Piece& piece = *static_cast<Piece*>(io_uring_cqe_get_data(cqe));
      try {
        if (!settle(piece, cqe->res)) again.push_back(&piece);
        else if (!failure) work.complete(piece);  // after a failure, what lands is dropped
      } catch (...) {
        failed();
      }
    }
    io_uring_cq_advance(ring.get(), seen);
  }
  if (failure) std::rethrow_exception(failure);
}

// read_staged's work: each range in chunks that each fill at most one buffer, read into
// whichever buffer is free. Chunks begin at multiples of the buffer size from the range's first
// aligned offset, so that a direct read of a chunk, padded to alignment, fits its buffer.
class StagedWork final : public Work {
 public:
  StagedWork(std::span<const StagedRange> ranges, StagingPool& pool, bool direct)
      : ranges_(ranges), pool_(pool), direct_(direct), chunk_(pool.buffer(0).size()), buffers_(pool.count()),
        pieces_(pool.count()) {
    skip_empty();
  }

  bool finished() const { return range_ == ranges_.size(); }

  Piece* next(bool idle) override {
    if (finished()) return nullptr;
    std::optional<unsigned> pick;
    for (unsigned i = 0; i < buffers_.size() && !pick; ++i)
      if (buffers_[i].state == State::Free || (buffers_[i].state == State::Taken && pool_.done(i))) pick = i;
    if (!pick && idle) {  // every buffer's copy is queued: wait for the oldest
      for (unsigned i = 0; i < buffers_.size(); ++i)
        if (buffers_[i].state == State::Taken && (!pick || buffers_[i].taken < buffers_[*pick].taken)) pick = i;
      if (pick) pool_.wait(*pick);
    }
    if (!pick) return nullptr;
    return &start(*pick);
  }

  void complete(Piece& piece) override {
    const auto i = static_cast<unsigned>(&piece - pieces_.data());
    Buffer& buffer = buffers_[i];
    buffer.state = State::Taken;
    buffer.taken = ++taken_;
    pool_.take({buffer.range, buffer.at, {pool_.buffer(i).data() + buffer.skip, buffer.size}, i});
  }

 private:
  enum class State { Free, Reading, Taken };
  struct Buffer {
    State state = State::Free;
    uint64_t taken = 0;  // when its chunk was taken, in takes
    size_t range = 0;
    uint64_t at = 0, skip = 0, size = 0;  // the chunk: bytes [at, at + size) of the range, `skip` into the buffer
  };

  void skip_empty() {
    while (range_ < ranges_.size() && ranges_[range_].size == 0) ++range_;
    if (range_ < ranges_.size()) window_ = File::align_down(ranges_[range_].offset);
  }

  // Piece i reading the next chunk into buffer i.
  Piece& start(unsigned i) {
    const StagedRange& range = ranges_[range_];
    const uint64_t end = range.offset + range.size;
    const uint64_t begin = std::max(window_, range.offset), stop = std::min(end, window_ + chunk_);
    std::byte* const memory = pool_.buffer(i).data();
    const int direct_fd = direct_ ? range.file->direct_fd() : -1;
    Piece& piece = pieces_[i];
    if (direct_fd >= 0) {
      piece = Piece(*range.file, direct_fd, true, window_, File::align_up(stop) - window_, memory);
      piece.need = stop - window_;
    } else {
      piece = Piece(*range.file, range.file->fd(), false, begin, stop - begin, memory + (begin - window_));
    }
    buffers_[i] = {State::Reading, 0, range_, begin - range.offset, begin - window_, stop - begin};
    window_ += chunk_;
    if (window_ >= end) {
      ++range_;
      skip_empty();
    }
    return piece;
  }

  std::span<const StagedRange> ranges_;
  StagingPool& pool_;
  bool direct_;
  uint64_t chunk_;
  std::vector<Buffer> buffers_;
  std::vector<Piece> pieces_;  // piece i reads into buffer i
  size_t range_ = 0;           // the range whose chunk is next
  uint64_t window_ = 0;        // where in its file the next chunk's buffer begins
  uint64_t taken_ = 0;
};

// Asked once: each call reads /sys/devices/system/cpu/online, which cost a small read (a LoRA
// file's alpha scalars, one each) more than the read itself.
unsigned cores() {
  static const unsigned count = std::max(1u, std::thread::hardware_concurrency());
  return count;
}

// Reads the work with the engine the options ask for, at most `depth` reads in flight; reads
// through the page cache on `buffered_threads` threads (at most `depth`).
void run(Work& work, bool direct, unsigned depth, ReaderOptions::Engine engine, unsigned buffered_threads) {
  using Engine = ReaderOptions::Engine;
  const bool uring = engine == Engine::Uring || (engine == Engine::Auto && direct);
  if (uring && io_uring_available())
    if (Ring* ring = Ring::get(depth)) return read_with_uring(work, *ring, depth);
  if (engine == Engine::Uring) throw ReadFailure("io_uring is not available to this process");
  read_with_threads(work, direct ? std::min(depth, 8u) : std::min(depth, buffered_threads));
}

// Whether the first piece, read through the page cache, finds its pages there: it is read as
// far as they are without waiting for the disk (RWF_NOWAIT), which starts the reading, and
// dropped once whole. Reads of cached pages are copies, which gain nothing from more threads
// than cores; reads that wait on the disk gain from as many in flight as asked (16 threads of
// 8 MiB reads read a cold 1.1 GiB file 1.5-2x faster than 2 here: docs/benchmarks.md).
bool first_cached(std::vector<Piece>& pieces) {
  Piece& piece = pieces.front();
  iovec into{piece.dst, piece.size};
  const ssize_t got = ::preadv2(piece.fd, &into, 1, static_cast<off_t>(piece.offset), RWF_NOWAIT);
  if (got <= 0) return false;  // not cached, or RWF_NOWAIT not taken (EOPNOTSUPP): read as usual
  piece.done = static_cast<uint64_t>(got);
  if (piece.done < piece.size) return false;
  pieces.erase(pieces.begin());
  return true;
}

}  // namespace

bool io_uring_available() {
  static const bool available = [] {
    io_uring ring{};
    if (io_uring_queue_init(2, &ring, 0) != 0) return false;
    io_uring_queue_exit(&ring);
    return true;
  }();
  return available;
}

void read_ranges(std::span<const ReadRange> ranges, const ReaderOptions& options) {
  std::vector<Piece> pieces;
  for (const auto& range : ranges) plan(range, options, pieces);
  if (pieces.empty()) return;
  const bool any_direct = std::any_of(pieces.begin(), pieces.end(), [](const Piece& p) { return p.direct; });
  unsigned buffered_threads = cores();
  if (!any_direct && options.engine != ReaderOptions::Engine::Uring && !first_cached(pieces)) buffered_threads = options.depth;
  if (pieces.empty()) return;
  const auto depth = static_cast<unsigned>(std::min<size_t>(std::max(1u, options.depth), pieces.size()));
  PieceList work(pieces);
  run(work, any_direct, depth, options.engine, buffered_threads);
}

void read_staged(std::span<const StagedRange> ranges, StagingPool& pool, const ReaderOptions& options) {
  if (pool.count() == 0) throw Error("a staged read needs at least one buffer");
  const uint64_t chunk = pool.buffer(0).size();
  for (unsigned i = 0; i < pool.count(); ++i) {
    const auto buffer = pool.buffer(i);
    if (buffer.size() != chunk || chunk == 0 || chunk % kAlign || reinterpret_cast<uintptr_t>(buffer.data()) % kAlign)
      throw Error("staging buffer " + std::to_string(i) + " is not " + std::to_string(chunk) + " bytes aligned to " +
                  std::to_string(kAlign));
  }
  StagedWork work(ranges, pool, options.direct);
  if (work.finished()) return;
  run(work, options.direct, std::min(std::max(1u, options.depth), pool.count()), options.engine, cores());
}

}  // namespace vramd::storage
