#include "storage/file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
  if (map_) ::munmap(map_, size_);
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
  if (::fstat(fd_, &st) != 0) throw ReadFailure(path_ + ": cannot stat: " + errno_text());
  if (offset + n > static_cast<uint64_t>(st.st_size))
    throw ReadFailure(path_ + ": now " + std::to_string(st.st_size) + " bytes, too short for bytes " +
                      std::to_string(offset) + " to " + std::to_string(offset + n) + " (was it changed while in use?)");
  const uint64_t start = offset - offset % page;
  const size_t length = offset + n - start;
  void* address = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd_, static_cast<off_t>(start));
  if (address == MAP_FAILED) throw ReadFailure(path_ + ": cannot map " + std::to_string(length) + " bytes: " + errno_text());
  ::madvise(address, length, MADV_WILLNEED);
  return {address, length};
}

}  // namespace vramd::storage
