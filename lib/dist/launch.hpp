// Starting a group's ranks on this machine: `vramctl run --ranks N` and `vramd` with
// [group].world_size start ranks 1..N-1 as copies of themselves, with the variables torchrun
// would set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and
// become rank 0. LibTorch-free.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace vramd::dist {

struct LocalRanks {
  std::vector<pid_t> children;   // ranks 1..N-1; -1: not running
  std::vector<std::string> argv;  // what they run
};

// Sets this process's environment to rank 0's and starts the others running `argv` (argv[0]
// is replaced by this executable). A free loopback port is chosen for the store.
LocalRanks start_local_ranks(int world_size, const std::vector<std::string>& argv);

// Waits for every child; one line per rank that failed ("rank 2 exited with status 1").
std::vector<std::string> wait_local_ranks(const LocalRanks& ranks);

// SIGTERM to every child that still runs, then waits for them.
void stop_local_ranks(const LocalRanks& ranks);

// "rank 2 exited with status 1", "rank 1 was killed by signal 9"; empty for a clean exit.
std::string describe_exit(int rank, int status);

// Keeps a daemon's local ranks running: a rank that exits is started again after a second, and
// `log` is told. The new rank finds rejoin_value()'s answer in VRAMD_REJOINED (the daemon's: the
// first command it is to follow). Destroying the supervisor stops the ranks.
class LocalRankSupervisor {
 public:
  LocalRankSupervisor(LocalRanks ranks, std::function<void(const std::string&)> log);
  void set_rejoin_value(std::function<std::string()> value);
  ~LocalRankSupervisor();
  LocalRankSupervisor(const LocalRankSupervisor&) = delete;
  LocalRankSupervisor& operator=(const LocalRankSupervisor&) = delete;

 private:
  void watch();

  LocalRanks ranks_;
  std::function<void(const std::string&)> log_;
  std::function<std::string()> rejoin_value_;
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::thread watcher_;
};

// Intra-op threads for one of several ranks sharing this machine: its cores divided among them
// (LOCAL_WORLD_SIZE), unless OMP_NUM_THREADS says otherwise. 0: leave LibTorch's default.
int threads_per_local_rank();

}  // namespace vramd::dist
