#include "dist/launch.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

}  // namespace

LocalRanks start_local_ranks(int world_size, const std::vector<std::string>& argv) {
  set("WORLD_SIZE", std::to_string(world_size));
  set("LOCAL_WORLD_SIZE", std::to_string(world_size));
  set("MASTER_ADDR", "127.0.0.1");
  set("MASTER_PORT", std::to_string(free_loopback_port()));
  LocalRanks ranks;
  std::vector<char*> args;
  for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  for (int rank = 1; rank < world_size; ++rank) {
    const pid_t pid = fork();
    if (pid < 0) {
      stop_local_ranks(ranks);
      throw Error(std::string("cannot start rank ") + std::to_string(rank) + ": " + std::strerror(errno));
    }
    if (pid == 0) {
      set("RANK", std::to_string(rank));
      set("LOCAL_RANK", std::to_string(rank));
      execv("/proc/self/exe", args.data());
      std::_Exit(127);
    }
    ranks.children.push_back(pid);
  }
  set("RANK", "0");
  set("LOCAL_RANK", "0");
  return ranks;
}

std::vector<std::string> wait_local_ranks(const LocalRanks& ranks) {
  std::vector<std::string> failed;
  for (size_t i = 0; i < ranks.children.size(); ++i) {
    int status = 0;
    while (waitpid(ranks.children[i], &status, 0) < 0 && errno == EINTR) {
    }
    const std::string rank = "rank " + std::to_string(i + 1);
    if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
      failed.push_back(rank + " exited with status " + std::to_string(WEXITSTATUS(status)));
    else if (WIFSIGNALED(status))
      failed.push_back(rank + " was killed by signal " + std::to_string(WTERMSIG(status)));
  }
  return failed;
}

void stop_local_ranks(const LocalRanks& ranks) {
  for (const pid_t pid : ranks.children) kill(pid, SIGTERM);
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
