#include "storage/page_cache.hpp"

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "util/format.hpp"

namespace vramd::storage {
namespace {

namespace fs = std::filesystem;

std::optional<uint64_t> number_in(const fs::path& file) {
  std::ifstream in(file);
  std::string word;
  if (!(in >> word) || word == "max") return std::nullopt;
  try {
    return std::stoull(word);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The value of `key` in a file of "key value" lines (memory.stat), or in /proc/meminfo's
// "Key:   value kB" lines (then in bytes).
std::optional<uint64_t> field(const fs::path& file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string name, unit;
    uint64_t value = 0;
    if (!(words >> name >> value)) continue;
    if (name == key || name == key + ":") return words >> unit && unit == "kB" ? value * 1024 : value;
  }
  return std::nullopt;
}

// This process's path in a cgroup hierarchy: v2's line "0::/path", or v1's "N:memory:/path".
std::optional<std::string> cgroup_path(const std::string& proc, bool v2) {
  std::ifstream in(proc + "/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    if (v2 ? controllers.empty() : controllers == "memory") return line.substr(second + 1);
  }
  return std::nullopt;
}

// Room a cgroup's limit leaves the cache: limit less what the group holds besides its cache.
std::optional<uint64_t> cgroup_room(const fs::path& dir, bool v2) {
  const auto limit = number_in(dir / (v2 ? "memory.max" : "memory.limit_in_bytes"));
  const auto usage = number_in(dir / (v2 ? "memory.current" : "memory.usage_in_bytes"));
  if (!limit || !usage || *limit >= (uint64_t{1} << 62)) return std::nullopt;
  const uint64_t cache = field(dir / "memory.stat", v2 ? "file" : "total_cache").value_or(0);
  const uint64_t other = *usage > cache ? *usage - cache : 0;
  return *limit > other ? *limit - other : 0;
}

}  // namespace

CacheRoom page_cache_room(const std::string& proc, const std::string& cgroup_root) {
  CacheRoom room{field(proc + "/meminfo", "MemAvailable").value_or(0), "MemAvailable"};
  for (const bool v2 : {true, false}) {
    const auto path = cgroup_path(proc, v2);
    if (!path) continue;
    const fs::path base = v2 ? fs::path(cgroup_root) : fs::path(cgroup_root) / "memory";
    // The group and each of its ancestors: any of their limits bounds this process.
    for (fs::path group = fs::path(*path).relative_path();; group = group.parent_path()) {
      if (const auto bytes = cgroup_room(base / group, v2); bytes && *bytes < room.bytes)
        room = {*bytes, "the memory cgroup /" + group.string()};
      if (group.empty()) break;
    }
  }
  return room;
}

DirectChoice choose_direct_io(uint64_t checkpoint_bytes, uint64_t held, const CacheRoom& room) {
  const uint64_t left = room.bytes > held ? room.bytes - held : 0;
  const std::string sizes = "the checkpoint's " + format_bytes(checkpoint_bytes);
  const std::string cache = format_bytes(left) + " the page cache can keep (" + room.where +
                            (held ? ", less " + format_bytes(held) + " of weights held" : "") + ")";
  if (checkpoint_bytes > left) return {true, "O_DIRECT: " + sizes + " exceed the " + cache};
  return {false, "page cache: " + sizes + " fit in the " + cache};
}

}  // namespace vramd::storage
