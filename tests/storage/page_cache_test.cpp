#include "storage/page_cache.hpp"

#include <catch2/catch.hpp>

#include <filesystem>

#include "support/temp_dir.hpp"

using namespace vramd::storage;
using vramd::test::TempDir;

namespace {

// A /proc with meminfo and self/cgroup, and a cgroup root beside it.
struct FakeSystem {
  TempDir dir;
  std::string proc() const { return dir / "proc"; }
  std::string cgroups() const { return dir / "cgroup"; }

  FakeSystem(const std::string& cgroup_lines) {
    std::filesystem::create_directories(dir.path() / "proc" / "self");
    dir.write("proc/meminfo", "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n");
    dir.write("proc/self/cgroup", cgroup_lines);
  }
  void group(const std::string& path, const std::string& file, const std::string& text) {
    std::filesystem::create_directories(dir.path() / "cgroup" / path);
    dir.write("cgroup/" + path + "/" + file, text);
  }
};

}  // namespace

TEST_CASE("the page cache's room is MemAvailable without a memory cgroup limit") {
  FakeSystem system("0::/\n");
  system.group("", "memory.max", "max\n");  // the root has no limit
  const CacheRoom room = page_cache_room(system.proc(), system.cgroups());
  CHECK(room.bytes == 20000000ull * 1024);
  CHECK(room.where == "MemAvailable");
}

TEST_CASE("a cgroup v2 limit on the group or an ancestor bounds the page cache's room") {
  FakeSystem system("0::/outer/inner\n");
  // inner: 8 GiB allowed, 3 GiB held of which 1 GiB is page cache: 6 GiB left for the cache.
  system.group("outer/inner", "memory.max", std::to_string(8ull << 30));
  system.group("outer/inner", "memory.current", std::to_string(3ull << 30));
  system.group("outer/inner", "memory.stat", "anon 2147483648\nfile " + std::to_string(1ull << 30) + "\n");
  CacheRoom room = page_cache_room(system.proc(), system.cgroups());
  CHECK(room.bytes == 6ull << 30);
  CHECK(room.where == "the memory cgroup /outer/inner");

  // An ancestor with less room wins.
  system.group("outer", "memory.max", std::to_string(4ull << 30));
  system.group("outer", "memory.current", std::to_string(3ull << 30));
  system.group("outer", "memory.stat", "file 0\n");
  room = page_cache_room(system.proc(), system.cgroups());
  CHECK(room.bytes == 1ull << 30);
  CHECK(room.where == "the memory cgroup /outer");
}

TEST_CASE("a cgroup v1 memory limit bounds the page cache's room") {
  FakeSystem system("4:memory:/jobs/one\n1:cpu:/\n0::/\n");
  system.group("memory/jobs/one", "memory.limit_in_bytes", std::to_string(2ull << 30));
  system.group("memory/jobs/one", "memory.usage_in_bytes", std::to_string(1ull << 30));
  system.group("memory/jobs/one", "memory.stat", "cache 536870912\nrss 536870912\ntotal_cache 536870912\n");
  system.group("memory", "memory.limit_in_bytes", "9223372036854771712\n");  // no limit at the root
  const CacheRoom room = page_cache_room(system.proc(), system.cgroups());
  CHECK(room.bytes == (3ull << 30) / 2);
  CHECK(room.where == "the memory cgroup /jobs/one");
}

TEST_CASE("direct_io = auto reads around the cache a checkpoint it cannot keep, and says why") {
  const CacheRoom room{10ull << 30, "MemAvailable"};
  const DirectChoice small = choose_direct_io(4ull << 30, 2ull << 30, room);
  CHECK_FALSE(small.direct);
  CHECK(small.why == "page cache: the checkpoint's 4.00 GiB fit in the 8.00 GiB the page cache can keep "
                     "(MemAvailable, less 2.00 GiB of weights held)");
  const DirectChoice large = choose_direct_io(9ull << 30, 2ull << 30, room);
  CHECK(large.direct);
  CHECK(large.why == "O_DIRECT: the checkpoint's 9.00 GiB exceed the 8.00 GiB the page cache can keep "
                     "(MemAvailable, less 2.00 GiB of weights held)");
  CHECK(choose_direct_io(11ull << 30, 0, room).why ==
        "O_DIRECT: the checkpoint's 11.00 GiB exceed the 10.00 GiB the page cache can keep (MemAvailable)");
}
