#include "storage/reader.hpp"

#include <catch2/catch.hpp>
#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "storage/file.hpp"
#include "support/temp_dir.hpp"
#include "util/error.hpp"

using namespace vramd;
using namespace vramd::storage;
using Engine = ReaderOptions::Engine;

namespace {

std::string pattern(size_t n) {
  std::string bytes(n, '\0');
  for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>((i * 2654435761u) >> 13);
  return bytes;
}

// Page-aligned memory that ASan sees freed once it goes.
struct Pages {
  explicit Pages(size_t n) : size(n), data(static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))) {}
  ~Pages() { std::free(data); }
  size_t size;
  std::byte* data;
};

std::vector<Engine> engines() {
  std::vector<Engine> all{Engine::Threads, Engine::Auto};
  if (io_uring_available()) all.push_back(Engine::Uring);
  else WARN("io_uring is not available here: only the threads engine is tested");
  return all;
}

bool has_direct_io(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

}  // namespace

TEST_CASE("read_ranges fills ranges of any alignment, size and phase, with every engine") {
  test::TempDir dir;
  const std::string bytes = pattern((3u << 20) + 123);  // ends inside a block
  const File file(dir.write("data.bin", bytes));
  // (offset, size, where in the buffer the range begins): aligned, unaligned, agreeing with
  // the offset modulo 4096 or not, a byte, nothing, across many blocks, up to the very end.
  const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> shapes{
      {0, 4096, 0},       {4096, 1 << 20, 0},      {100, 5000, 100},       {100, 5000, 0},
      {4095, 2, 4095},    {7, 1, 3},               {12345, 0, 0},          {8191, 1 << 21, 8191 % 4096},
      {1 << 20, 4096 * 3, 12}, {bytes.size() - 5000, 5000, (bytes.size() - 5000) % 4096},
      {bytes.size() - 1, 1, 0}, {0, bytes.size(), 0}};
  Pages memory(bytes.size() * 2 + (1 << 22));
  for (const Engine engine : engines())
    for (const bool direct : {false, true})
      for (const uint64_t block : {uint64_t{8} << 20, uint64_t{12288}}) {
        std::memset(memory.data, 0xEE, memory.size);
        std::vector<ReadRange> ranges;
        uint64_t at = 0;
        for (const auto& [offset, size, phase] : shapes) {
          at = (at + 4096) / 4096 * 4096 + phase;  // at least a byte after the last one
          ranges.push_back({&file, offset, {memory.data + at, size}});
          at += size;
        }
        read_ranges(ranges, {.direct = direct, .depth = 5, .block = block, .engine = engine});
        for (size_t i = 0; i < ranges.size(); ++i) {
          INFO("engine " << static_cast<int>(engine) << ", direct " << direct << ", block " << block << ", range " << i);
          const auto& range = ranges[i];
          CHECK(std::memcmp(range.dst.data(), bytes.data() + range.offset, range.dst.size()) == 0);
          // Not a byte around a range is touched.
          if (range.dst.data() > memory.data) CHECK(range.dst.data()[-1] == std::byte{0xEE});
          CHECK(range.dst.data()[range.dst.size()] == std::byte{0xEE});
        }
      }
}

TEST_CASE("a file cut short while it is read fails every read past its end with one error naming it") {
  test::TempDir dir;
  const std::string path = dir.write("cut.bin", pattern(4u << 20));
  const File file(path);  // opened at its full size
  std::filesystem::resize_file(path, (1u << 20) + 100);
  Pages memory(4u << 20);
  for (const Engine engine : engines())
    for (const bool direct : {false, true}) {
      INFO("engine " << static_cast<int>(engine) << ", direct " << direct);
      // 1024 reads of 4 KiB, 16 in flight, and most of them fail at once.
      const ReadRange whole{&file, 0, {memory.data, 4u << 20}};
      try {
        read_ranges({&whole, 1}, {.direct = direct, .depth = 16, .block = 4096, .engine = engine});
        FAIL("a read past the end succeeded");
      } catch (const Error& error) {
        CHECK_THAT(error.what(), Catch::StartsWith(path + ": unexpected end of file at offset "));
        CHECK_THAT(error.what(), Catch::EndsWith("(was it cut short while in use?)"));
      }
      // Once it has thrown, nothing more is written into the buffer.
      std::memset(memory.data, 0x5A, memory.size);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      bool untouched = true;
      for (size_t i = 0; i < memory.size; ++i) untouched &= memory.data[i] == std::byte{0x5A};
      CHECK(untouched);
      // What the file still holds reads as before.
      const ReadRange head{&file, 100, {memory.data + 100, 1u << 20}};
      read_ranges({&head, 1}, {.direct = direct, .engine = engine});
      CHECK(std::memcmp(memory.data + 100, pattern(4u << 20).data() + 100, 1u << 20) == 0);
    }
}

TEST_CASE("direct reads on a file system without O_DIRECT go through the page cache") {
  // ramfs refuses O_DIRECT (tmpfs takes it since Linux 6.6); mounting one needs root.
  test::TempDir dir;
  const std::string folder = dir / "ramfs";
  std::filesystem::create_directory(folder);
  struct Mount {
    std::string path;
    bool mounted = ::mount("ramfs", path.c_str(), "ramfs", 0, nullptr) == 0;
    ~Mount() {
      if (mounted) ::umount2(path.c_str(), MNT_DETACH);
    }
  } ramfs{folder};
  if (!ramfs.mounted) WARN("cannot mount a ramfs here (not root?): the reads run where O_DIRECT works");
  const std::string bytes = pattern((1u << 20) + 7);
  const std::string path = dir.write("ramfs/data.bin", bytes);
  if (ramfs.mounted) CHECK_FALSE(has_direct_io(path));
  const File file(path);
  if (ramfs.mounted) CHECK(file.direct_fd() == -1);
  Pages memory(bytes.size());
  for (const Engine engine : engines()) {
    std::memset(memory.data, 0, memory.size);
    const ReadRange range{&file, 3, {memory.data + 3, bytes.size() - 3}};
    read_ranges({&range, 1}, {.direct = true, .engine = engine});
    CHECK(std::memcmp(memory.data + 3, bytes.data() + 3, bytes.size() - 3) == 0);
  }
}
