#include "util/subprocess.hpp"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "util/error.hpp"
#include "util/file.hpp"
#include "util/unique_fd.hpp"

extern char** environ;

namespace vramd {

namespace {

constexpr size_t kErrorTail = 64 << 10;

UniqueFd input_file(const std::string& input) {
  // A sealed-off memfd rather than a pipe: the child reads it at its pace, and no write of ours
  // can raise SIGPIPE where it exits without reading.
  UniqueFd fd(::memfd_create("vramd-input", MFD_CLOEXEC));
  if (fd.get() < 0) throw Error(std::string("memfd_create: ") + std::strerror(errno));
  write_all(fd.get(), input.data(), input.size(), "a program's input");
  if (::lseek(fd.get(), 0, SEEK_SET) < 0) throw Error(std::string("lseek: ") + std::strerror(errno));
  return fd;
}

}  // namespace

ProcessResult run_process(const std::vector<std::string>& argv, const std::string& input,
                          std::chrono::milliseconds timeout, size_t max_output) {
  const std::string& program = argv.at(0);
  UniqueFd in = input_file(input);
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw Error(program + ": pipe: " + std::strerror(errno));
  UniqueFd out_read(out[0]), out_write(out[1]);
  if (::pipe2(err, O_CLOEXEC) != 0) throw Error(program + ": pipe: " + std::strerror(errno));
  UniqueFd err_read(err[0]), err_write(err[1]);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in.get(), 0);
  posix_spawn_file_actions_adddup2(&actions, out_write.get(), 1);
  posix_spawn_file_actions_adddup2(&actions, err_write.get(), 2);
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);  // the daemon's sockets and memfds stay its own
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);  // the daemon ignores it; the program gets the usual default
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setsigdefault(&attributes, &defaults);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int started = ::posix_spawnp(&pid, program.c_str(), &actions, &attributes, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  if (started != 0) throw Error("cannot run " + program + ": " + std::strerror(started));
  out_write.reset();
  err_write.reset();

  ProcessResult result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool out_open = true, err_open = true;
  char buffer[65536];
  while ((out_open || err_open) && !result.timed_out && !result.too_much) {
    pollfd fds[2] = {{out_open ? out_read.get() : -1, POLLIN, 0}, {err_open ? err_read.get() : -1, POLLIN, 0}};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      result.timed_out = true;
      break;
    }
    if (::poll(fds, 2, static_cast<int>(left.count())) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        (i == 0 ? out_open : err_open) = false;
        continue;
      }
      if (i == 0) {
        result.out.append(buffer, static_cast<size_t>(n));
        result.too_much = result.out.size() > max_output;
      } else {
        result.err.append(buffer, static_cast<size_t>(n));
        if (result.err.size() > 2 * kErrorTail) result.err.erase(0, result.err.size() - kErrorTail);
      }
    }
  }
  if (result.timed_out || result.too_much) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (result.err.size() > kErrorTail) result.err.erase(0, result.err.size() - kErrorTail);
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

}  // namespace vramd
