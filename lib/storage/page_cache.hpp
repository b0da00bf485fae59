// How much of a checkpoint the page cache can keep, for `direct_io = "auto"`: a checkpoint that
// stays cached is best read through the cache (later reads cost a copy from memory, and CPU
// weights can be views of it); one that cannot stay is best read around it (O_DIRECT), since
// caching it only evicts what the cache held before, read after read.
#pragma once

#include <cstdint>
#include <string>

namespace vramd::storage {

struct CacheRoom {
  uint64_t bytes = 0;
  std::string where;  // what bounds it: "MemAvailable" or "the memory cgroup <path>"
};

// MemAvailable, or less where this process's memory cgroup (v2 or v1, itself or an ancestor)
// leaves less: its limit less what it holds other than page cache. `proc` and `cgroup_root`
// are /proc and /sys/fs/cgroup, there to be replaced by tests.
CacheRoom page_cache_room(const std::string& proc = "/proc", const std::string& cgroup_root = "/sys/fs/cgroup");

struct DirectChoice {
  bool direct = false;
  std::string why;  // for the plan: "O_DIRECT: the checkpoint's 24.2 GiB exceed ..."
};

// `direct_io = "auto"`: O_DIRECT when `checkpoint_bytes` exceed the room less `held` (the
// model's own weights in host memory, which compete with the cache for it).
DirectChoice choose_direct_io(uint64_t checkpoint_bytes, uint64_t held, const CacheRoom& room);

}  // namespace vramd::storage
