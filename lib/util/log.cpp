#include "util/log.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>

#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::log {
namespace {

std::atomic<Level> threshold{Level::Info};
std::mutex output;
int file = -1;  // the configured log file, under `output`

// systemd sets JOURNAL_STREAM to "DEVICE:INODE" of the stream it connects stdout and stderr to;
// when that is still our stderr, the journal reads a "<N>" prefix as the line's priority.
bool stderr_is_journal() {
  const char* stream = std::getenv("JOURNAL_STREAM");
  if (!stream) return false;
  unsigned long long device = 0, inode = 0;
  struct stat info {};
  return std::sscanf(stream, "%llu:%llu", &device, &inode) == 2 && ::fstat(STDERR_FILENO, &info) == 0 &&
         info.st_dev == device && info.st_ino == inode;
}

}  // namespace

void set_level(std::string_view level) {
  threshold = level == "error" ? Level::Error : level == "warn" ? Level::Warn : level == "debug" ? Level::Debug : Level::Info;
}

void open_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
  if (fd < 0) fail(path, std::string("cannot open the log file: ") + std::strerror(errno));
  std::lock_guard lock(output);
  if (file >= 0) ::close(file);
  file = fd;
}

bool enabled(Level level) { return level <= threshold.load(std::memory_order_relaxed); }

void write(Level level, const std::string& message) {
  if (!enabled(level)) return;
  static const char* names[] = {"error", "warn", "info", "debug"};
  static const char* priorities[] = {"<3>", "<4>", "<6>", "<7>"};  // syslog's err, warning, info, debug
  static const bool journal = stderr_is_journal();
  const int index = static_cast<int>(level);
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ ", ::gmtime_r(&now, &utc));
  // Each line of a message (a config's problems are one a line) a log line of its own, with the
  // prefix and priority, and nothing a terminal would act on: messages quote files and requests.
  std::string to_stderr, to_file;
  for (const auto& line : split_lines(message)) {
    const std::string text = std::string("vramd: ") + names[index] + ": " + printable(line) + "\n";
    to_stderr += (journal ? priorities[index] : "") + text;
    to_file += stamp + text;
  }
  std::lock_guard lock(output);
  std::fputs(to_stderr.c_str(), stderr);
  // One write but for a short one; a full disk loses the rest.
  for (size_t done = 0; file >= 0 && done < to_file.size();) {
    const ssize_t n = ::write(file, to_file.data() + done, to_file.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

}  // namespace vramd::log
