#include "storage/file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "util/error.hpp"
#include "util/file.hpp"

namespace vramd::storage {
namespace {

constexpr size_t kDirectAlignment = File::kDirectAlignment;
constexpr size_t kDirectChunk = 8u << 20;

std::string errno_text() { return std::strerror(errno); }

void pread_exact(int fd, std::byte* dst, size_t size, uint64_t offset, const std::string& path) {
  while (size > 0) {
    ssize_t got = ::pread(fd, dst, size, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail(path, "read of " + std::to_string(size) + " bytes at offset " +
                                std::to_string(offset) + " failed: " + errno_text());
    if (got == 0) fail(path, "unexpected end of file at offset " + std::to_string(offset));
    dst += got;
    size -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

struct AlignedFree {
  void operator()(std::byte* p) const { std::free(p); }
};

}  // namespace

File::File(std::string path) : path_(std::move(path)) {
  const OpenedFile opened = open_regular_file(path_);  // a FIFO is refused, not waited on
  fd_ = opened.fd;
  size_ = opened.size;
}

File::~File() {
  if (map_) ::munmap(map_, size_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
  ::close(fd_);
}

void File::read(std::span<std::byte> dst, uint64_t offset) const {
  pread_exact(fd_, dst.data(), dst.size(), offset, path_);
}

void File::read_direct(std::span<std::byte> dst, uint64_t offset) const {
  std::call_once(direct_once_, [this] {
    direct_fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  });
  if (direct_fd_ < 0) return read(dst, offset);  // e.g. tmpfs has no O_DIRECT

  const bool aligned = (reinterpret_cast<uintptr_t>(dst.data()) | offset | dst.size()) % kDirectAlignment == 0;
  if (aligned) {
    // Straight into the caller's buffer; the last block may end past the end of the file.
    uint64_t position = offset;
    std::byte* out = dst.data();
    const uint64_t last = offset + dst.size();
    while (position < last && position < size_) {
      ssize_t got = ::pread(direct_fd_, out, last - position, static_cast<off_t>(position));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && errno == EINVAL) return read(dst.first(std::min<uint64_t>(dst.size(), size_ - offset)), offset);
      if (got < 0) fail(path_, "direct read at offset " + std::to_string(position) + " failed: " + errno_text());
      if (got == 0) fail(path_, "unexpected end of file at offset " + std::to_string(position));
      out += got;
      position += static_cast<uint64_t>(got);
    }
    return;
  }

  const uint64_t first = offset & ~static_cast<uint64_t>(kDirectAlignment - 1);
  const uint64_t last = offset + dst.size();
  const size_t chunk = static_cast<size_t>(std::min<uint64_t>(
      kDirectChunk, (last - first + kDirectAlignment - 1) & ~static_cast<uint64_t>(kDirectAlignment - 1)));
  std::unique_ptr<std::byte, AlignedFree> bounce(
      static_cast<std::byte*>(std::aligned_alloc(kDirectAlignment, std::max(chunk, kDirectAlignment))));
  if (!bounce) fail(path_, "cannot allocate a buffer for direct reads");

  uint64_t position = first;
  std::byte* out = dst.data();
  while (position < last) {
    ssize_t got = ::pread(direct_fd_, bounce.get(), chunk, static_cast<off_t>(position));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && errno == EINVAL) return read(dst, offset);
    if (got < 0) fail(path_, "direct read at offset " + std::to_string(position) + " failed: " + errno_text());
    if (got == 0) fail(path_, "unexpected end of file at offset " + std::to_string(position));
    const uint64_t got_end = position + static_cast<uint64_t>(got);
    const uint64_t from = std::max(position, offset);
    const uint64_t to = std::min(got_end, last);
    if (to > from) {
      std::memcpy(out, bounce.get() + (from - position), to - from);
      out += to - from;
    }
    position = got_end;
  }
}

std::span<std::byte> File::mapping() const {
  std::call_once(map_once_, [this] {
    if (size_ == 0) return;
    void* address = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd_, 0);
    if (address == MAP_FAILED) fail(path_, "cannot map: " + errno_text());
    map_ = static_cast<std::byte*>(address);
  });
  return {map_, map_ ? size_ : 0};
}

std::pair<void*, size_t> File::map_range(uint64_t offset, uint64_t n) const {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail(path_, "cannot stat: " + errno_text());
  if (offset + n > static_cast<uint64_t>(st.st_size))
    fail(path_, "now " + std::to_string(st.st_size) + " bytes, too short for bytes " + std::to_string(offset) +
                    " to " + std::to_string(offset + n) + " (was it changed while in use?)");
  const uint64_t start = offset - offset % page;
  const size_t length = offset + n - start;
  void* address = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd_, static_cast<off_t>(start));
  if (address == MAP_FAILED) fail(path_, "cannot map " + std::to_string(length) + " bytes: " + errno_text());
  ::madvise(address, length, MADV_WILLNEED);
  return {address, length};
}

}  // namespace vramd::storage
