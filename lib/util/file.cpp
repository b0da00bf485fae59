#include "util/file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

class Descriptor {
 public:
  explicit Descriptor(int fd) : fd_(fd) {}
  ~Descriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace

OpenedFile open_regular_file(const std::string& path) {
  const auto refuse = [&](const std::string& why) { fail(escape_invalid_utf8(path), why); };
  const auto not_regular = [&](mode_t mode) { refuse(std::string("is ") + kind_of(mode) + ", not a regular file; refused"); };
  // O_NONBLOCK: opening a FIFO with no writer must not wait for one.
  Descriptor fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  struct stat info {};
  if (fd.get() < 0) {
    const int error = errno;
    if (::stat(path.c_str(), &info) == 0 && !S_ISREG(info.st_mode)) not_regular(info.st_mode);  // a socket cannot be opened
    refuse(std::string("cannot open: ") + std::strerror(error));
  }
  if (::fstat(fd.get(), &info) != 0) refuse(std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(info.st_mode)) not_regular(info.st_mode);
  return {fd.release(), static_cast<uint64_t>(info.st_size)};
}

std::string read_regular_file(const std::string& path, uint64_t max_bytes) {
  const OpenedFile opened = open_regular_file(path);
  const Descriptor fd(opened.fd);
  const std::string name = escape_invalid_utf8(path);
  const auto too_large = [&] {
    fail(name, "is larger than " + format_bytes(max_bytes) + ", the most a file of its kind may hold; refused");
  };
  if (opened.size > max_bytes) too_large();
  std::string bytes(static_cast<size_t>(opened.size) + 1, '\0');  // one more: a file that grew shows it
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(name, std::string("cannot read: ") + std::strerror(errno));
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  if (done > opened.size) {
    if (done > max_bytes) too_large();
    fail(name, "changed while it was read; try again once it is written");
  }
  bytes.resize(done);
  return bytes;
}

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const auto* cursor = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t wrote = ::write(fd, cursor, size);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote < 0) fail(path, std::string("write failed: ") + std::strerror(errno));
    cursor += wrote;
    size -= static_cast<size_t>(wrote);
  }
}

}  // namespace vramd
