#include "storage/file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "util/error.hpp"
#include "util/file.hpp"

namespace vramd::storage {
namespace {

std::string errno_text() { return std::strerror(errno); }

void pread_exact(int fd, std::byte* dst, size_t size, uint64_t offset, const std::string& path) {
  while (size > 0) {
    ssize_t got = ::pread(fd, dst, size, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0)
      throw ReadFailure(path + ": read of " + std::to_string(size) + " bytes at offset " + std::to_string(offset) +
                        " failed: " + errno_text());
    if (got == 0)
      throw ReadFailure(path + ": unexpected end of file at offset " + std::to_string(offset) +
                        " (was it cut short while in use?)");
    dst += got;
    size -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

}  // namespace

File::File(std::string path) : path_(std::move(path)) {
  const OpenedFile opened = open_regular_file(path_);  // a FIFO is refused, not waited on
  fd_ = opened.fd;
  size_ = opened.size;
}

File::~File() {
  map_.reset();
  if (direct_fd_ >= 0) ::close(direct_fd_);
  ::close(fd_);
}

void File::read(std::span<std::byte> dst, uint64_t offset) const {
  pread_exact(fd_, dst.data(), dst.size(), offset, path_);
}

int File::direct_fd() const {
  std::call_once(direct_once_, [this] { direct_fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT); });
  return direct_fd_;
}

std::span<std::byte> File::mapping() const {
  std::call_once(map_once_, [this] {
    if (size_ > 0) map_ = std::make_unique<Mapping>(path_, fd_, 0, size_, true, lost_);
    mapped_.store(true, std::memory_order_release);
  });
  return map_ ? std::span<std::byte>{map_->data(), map_->size()} : std::span<std::byte>{};
}

void File::unmap_pages_except(std::span<const std::pair<uint64_t, uint64_t>> keep) const {
  if (!mapped_.load(std::memory_order_acquire) || !map_) return;
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  // Whole pages between the kept ranges (a page a kept range touches stays).
  const auto drop = [&](uint64_t begin, uint64_t end) {
    begin = (begin + page - 1) / page * page;
    end = end >= map_->size() ? map_->size() : end / page * page;  // the last page, though partial
    if (begin < end) ::madvise(map_->data() + begin, end - begin, MADV_DONTNEED);
  };
  uint64_t from = 0;
  for (const auto& [begin, end] : keep) {
    if (begin > from) drop(from, begin);
    from = std::max(from, end);
  }
  drop(from, map_->size());
}

std::unique_ptr<Mapping> File::map_range(uint64_t offset, uint64_t n) const {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw ReadFailure(path_ + ": cannot stat: " + errno_text());
  if (offset + n > static_cast<uint64_t>(st.st_size))
    throw ReadFailure(path_ + ": unexpected end of file: now " + std::to_string(st.st_size) +
                      " bytes, too short for bytes " + std::to_string(offset) + " to " + std::to_string(offset + n) +
                      " (was it cut short while in use?)");
  const uint64_t start = offset - offset % page;
  auto mapping = std::make_unique<Mapping>(path_, fd_, start, offset + n - start, false, lost_);
  ::madvise(mapping->data(), mapping->size(), MADV_WILLNEED);
  return mapping;
}

void File::check_mappings() const {
  if (lost_->load())
    throw MappingLost(path_ + ": unexpected end of file: it was cut short while mapped, and weights read from it "
                      "since are not its bytes (was it overwritten in place?); they are read again once it is whole");
}

}  // namespace vramd::storage
