#include "storage/reader.hpp"

#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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

// One request: `size` bytes of the file at `offset`, into `dst`, or into a bounce buffer of
// its own when `out` is set, of which bytes [skip, skip + out_size) are then copied to `out`.
struct Piece {
  Piece(const File& file, int fd, bool direct, uint64_t offset, uint64_t size, std::byte* dst)
      : file(&file), fd(fd), direct(direct), offset(offset), size(size), dst(dst) {}

  const File* file;
  int fd;
  bool direct;
  uint64_t offset, size;
  std::byte* dst;
  std::byte* out = nullptr;
  uint64_t skip = 0, out_size = 0;
  uint64_t done = 0;  // bytes read so far
  std::unique_ptr<std::byte, FreeAligned> bounce;

  uint64_t needed() const { return out ? skip + out_size : size; }  // past it lies only padding
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
  if (piece.done < piece.needed()) return false;
  if (piece.out) std::memcpy(piece.out, piece.bounce.get() + piece.skip, piece.out_size);
  piece.bounce.reset();
  return true;
}

// The rest of a piece through the page cache, when O_DIRECT is refused on it (EINVAL: a file
// system that takes O_DIRECT opens but not these reads) or has ended on an unaligned count.
void finish_buffered(Piece& piece) {
  const uint64_t from = std::max(piece.done, piece.skip);
  std::byte* out = piece.out ? piece.out + (from - piece.skip) : piece.dst + from;
  const uint64_t to = piece.needed();
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

void read_with_threads(std::vector<Piece>& pieces, unsigned threads) {
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto worker = [&] {
    for (size_t i = next++; i < pieces.size(); i = next++) {
      try {
        read_piece(pieces[i]);
      } catch (...) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = pieces.size();  // start nothing more; the reads of other threads finish first
      }
    }
  };
  std::vector<std::thread> pool;
  threads = static_cast<unsigned>(std::min<size_t>(threads, pieces.size()));
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& thread : pool) thread.join();
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

void read_with_uring(std::vector<Piece>& pieces, Ring& ring, unsigned depth) {
  std::vector<size_t> queue;  // pieces to (re)submit, last first
  for (size_t i = pieces.size(); i-- > 0;) queue.push_back(i);
  std::optional<ReadFailure> failure;
  unsigned in_flight = 0;
  auto failed = [&](const std::exception& error) {
    if (!failure) failure.emplace(error.what());
  };
  while (in_flight > 0 || (!failure && !queue.empty())) {
    while (!failure && !queue.empty() && in_flight < depth) {
      Piece& piece = pieces[queue.back()];
      try {
        allocate_bounce(piece);
      } catch (const ReadFailure& error) {
        failed(error);
        break;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(ring.get());
      if (!sqe) break;
      io_uring_prep_read(sqe, piece.fd, piece.target() + piece.done, static_cast<unsigned>(piece.size - piece.done),
                         piece.offset + piece.done);
      io_uring_sqe_set_data64(sqe, queue.back());
      queue.pop_back();
      ++in_flight;
    }
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
      const size_t index = io_uring_cqe_get_data64(cqe);
      const int res = cqe->res;
      try {
        if (!settle(pieces[index], res)) queue.push_back(index);
      } catch (const ReadFailure& error) {
        failed(error);
      }
    }
    io_uring_cq_advance(ring.get(), seen);
  }
  if (failure) throw *failure;
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
  const unsigned depth = std::max(1u, options.depth);
  const bool any_direct = std::any_of(pieces.begin(), pieces.end(), [](const Piece& p) { return p.direct; });
  using Engine = ReaderOptions::Engine;
  const bool uring = options.engine == Engine::Uring || (options.engine == Engine::Auto && any_direct);
  if (uring && io_uring_available())
    if (Ring* ring = Ring::get(depth)) return read_with_uring(pieces, *ring, depth);
  if (options.engine == Engine::Uring) throw ReadFailure("io_uring is not available to this process");
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  read_with_threads(pieces, any_direct ? std::min(depth, 8u) : std::min(depth, cores));
}

}  // namespace vramd::storage
