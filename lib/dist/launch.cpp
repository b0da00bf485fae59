#include "dist/launch.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "util/error.hpp"

namespace vramd::dist {
namespace {

uint16_t free_loopback_port() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("cannot open a socket to find a free port: ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const int error = errno;
    close(fd);
    throw Error(std::string("cannot find a free loopback port: ") + std::strerror(error));
  }
  close(fd);
  return ntohs(address.sin_port);
}

void set(const char* name, const std::string& value) { setenv(name, value.c_str(), 1); }

// Starts `rank` running ranks.argv as this executable, with this process's environment but its
// own RANK and LOCAL_RANK. Everything is prepared before fork: the child only execs, as a
// child of a process with threads must.
pid_t start_rank(const LocalRanks& ranks, int rank, const std::string& rejoin = {}) {
  std::vector<std::string> environment;
  for (char** entry = environ; *entry; ++entry) {
    const std::string_view text(*entry);
    if (!text.starts_with("RANK=") && !text.starts_with("LOCAL_RANK=") && !text.starts_with("VRAMD_REJOINED="))
      environment.emplace_back(text);
  }
  environment.push_back("RANK=" + std::to_string(rank));
  environment.push_back("LOCAL_RANK=" + std::to_string(rank));
  if (!rejoin.empty()) environment.push_back("VRAMD_REJOINED=" + rejoin);
  std::vector<char*> args, envp;
  for (const auto& arg : ranks.argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  for (const auto& entry : environment) envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) throw Error(std::string("cannot start rank ") + std::to_string(rank) + ": " + std::strerror(errno));
  if (pid == 0) {
    execve("/proc/self/exe", args.data(), envp.data());
    std::_Exit(127);
  }
  return pid;
}

}  // namespace

LocalRanks start_local_ranks(int world_size, const std::vector<std::string>& argv) {
  set("WORLD_SIZE", std::to_string(world_size));
  set("LOCAL_WORLD_SIZE", std::to_string(world_size));
  set("MASTER_ADDR", "127.0.0.1");
  set("MASTER_PORT", std::to_string(free_loopback_port()));
  LocalRanks ranks;
  ranks.argv = argv;
  for (int rank = 1; rank < world_size; ++rank) {
    try {
      ranks.children.push_back(start_rank(ranks, rank));
    } catch (const Error&) {
      stop_local_ranks(ranks);
      throw;
    }
  }
  set("RANK", "0");
  set("LOCAL_RANK", "0");
  return ranks;
}

std::vector<std::string> wait_local_ranks(const LocalRanks& ranks) {
  std::vector<std::string> failed;
  for (size_t i = 0; i < ranks.children.size(); ++i) {
    int status = 0;
    if (ranks.children[i] <= 0) continue;  // not running (a restart that failed)
    while (waitpid(ranks.children[i], &status, 0) < 0 && errno == EINTR) {
    }
    if (auto text = describe_exit(static_cast<int>(i + 1), status); !text.empty()) failed.push_back(std::move(text));
  }
  return failed;
}

std::string describe_exit(int rank, int status) {
  const std::string name = "rank " + std::to_string(rank);
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0) return name + " exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return name + " was killed by signal " + std::to_string(WTERMSIG(status));
  return {};
}

LocalRankSupervisor::LocalRankSupervisor(LocalRanks ranks, std::function<void(const std::string&)> log)
    : ranks_(std::move(ranks)), log_(std::move(log)), watcher_([this] { watch(); }) {}

void LocalRankSupervisor::set_rejoin_value(std::function<std::string()> value) {
  std::lock_guard lock(mutex_);
  rejoin_value_ = std::move(value);
}

LocalRankSupervisor::~LocalRankSupervisor() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  stop_.notify_all();
  watcher_.join();
  stop_local_ranks(ranks_);
}

void LocalRankSupervisor::watch() {
  std::unique_lock lock(mutex_);
  while (!stop_.wait_for(lock, std::chrono::milliseconds(200), [&] { return stopping_; })) {
    for (size_t i = 0; i < ranks_.children.size(); ++i) {
      pid_t& pid = ranks_.children[i];
      const int rank = static_cast<int>(i + 1);
      int status = 0;
      if (pid > 0) {  // else its last start failed: try again
        if (waitpid(pid, &status, WNOHANG) != pid) continue;
        const std::string what = describe_exit(rank, status);
        log_((what.empty() ? "rank " + std::to_string(rank) + " exited" : what) + " (pid " + std::to_string(pid) +
             "); starting it again in 1s");
        pid = -1;
      }
      if (stop_.wait_for(lock, std::chrono::seconds(1), [&] { return stopping_; })) return;
      try {
        pid = start_rank(ranks_, rank, rejoin_value_ ? rejoin_value_() : "1");
        log_("rank " + std::to_string(rank) + " started again (pid " + std::to_string(pid) + ")");
      } catch (const std::exception& e) {  // its start, or the rejoin value (the group's store)
        log_(std::string("cannot start rank ") + std::to_string(rank) + " again: " + e.what());
      }
    }
  }
}

void stop_local_ranks(const LocalRanks& ranks) {
  for (const pid_t pid : ranks.children)
    if (pid > 0) kill(pid, SIGTERM);
  wait_local_ranks(ranks);
}

int threads_per_local_rank() {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  if ((omp && *omp) || !local) return 0;
  const int ranks = std::atoi(local);
  if (ranks <= 1) return 0;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks);
}

}  // namespace vramd::dist
