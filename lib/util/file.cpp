#include "util/file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

 private:
  int fd_;
};

}  // namespace

std::string read_regular_file(const std::string& path, uint64_t max_bytes) {
  const std::string name = escape_invalid_utf8(path);
  // O_NONBLOCK: opening a FIFO with no writer must not wait for one.
  const Descriptor fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  struct stat info {};
  if (fd.get() < 0) {
    const int error = errno;
    if (::stat(path.c_str(), &info) == 0 && !S_ISREG(info.st_mode))  // a socket cannot be opened at all
      fail(name, std::string("is ") + kind_of(info.st_mode) + ", not a regular file; refused");
    fail(name, std::string("cannot open: ") + std::strerror(error));
  }
  if (::fstat(fd.get(), &info) != 0) fail(name, std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(info.st_mode)) fail(name, std::string("is ") + kind_of(info.st_mode) + ", not a regular file; refused");
  const auto too_large = [&] {
    fail(name, "is larger than " + format_bytes(max_bytes) + ", the most a file of its kind may hold; refused");
  };
  if (static_cast<uint64_t>(info.st_size) > max_bytes) too_large();
  std::string bytes(static_cast<size_t>(info.st_size) + 1, '\0');  // one more: a file that grew shows it
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(name, std::string("cannot read: ") + std::strerror(errno));
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  if (done > static_cast<size_t>(info.st_size)) {
    if (done > max_bytes) too_large();
    fail(name, "changed while it was read; try again once it is written");
  }
  bytes.resize(done);
  return bytes;
}

}  // namespace vramd
