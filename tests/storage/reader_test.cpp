#include "storage/reader.hpp"

#include <catch2/catch.hpp>
#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
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

// Staging buffers in host memory whose copies out run later, on a thread of their own, as a
// device's copies do: each copy checks that its buffer still holds what it held when taken,
// so a buffer read into again before its copy was done is caught.
class SlowCopies final : public StagingPool {
 public:
  SlowCopies(unsigned count, size_t size, std::vector<std::string>& outs) : memory_(count * size), size_(size), busy_(count), outs_(outs) {
    copier_ = std::thread([this] { copy_loop(); });
  }
  ~SlowCopies() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    copier_.join();
  }

  unsigned count() const override { return static_cast<unsigned>(busy_.size()); }
  std::span<std::byte> buffer(unsigned i) override { return {memory_.data + i * size_, size_}; }
  void take(const LandedChunk& chunk) override {
    if (fail_at && takes + 1 == fail_at) throw std::runtime_error("the copy was refused");
    CHECK(chunk.bytes.size() <= size_);
    CHECK(chunk.bytes.data() >= buffer(chunk.buffer).data());
    CHECK(chunk.bytes.data() + chunk.bytes.size() <= buffer(chunk.buffer).data() + size_);
    std::lock_guard lock(mutex_);
    ++takes;
    landed[chunk.range] += chunk.bytes.size();
    busy_[chunk.buffer] = true;
    queue_.push_back({chunk, std::string(reinterpret_cast<const char*>(chunk.bytes.data()), chunk.bytes.size())});
    changed_.notify_all();
  }
  bool done(unsigned i) override {
    std::lock_guard lock(mutex_);
    return !busy_[i];
  }
  void wait(unsigned i) override {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return !busy_[i]; });
    ++waits;
  }
  void drain() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return queue_.empty() && std::none_of(busy_.begin(), busy_.end(), [](bool b) { return b; }); });
  }

  // Whether nothing writes into the buffers any more: they keep what is written into them now.
  bool left_alone() {
    std::memset(memory_.data, 0x5A, memory_.size);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (size_t i = 0; i < memory_.size; ++i)
      if (memory_.data[i] != std::byte{0x5A}) return false;
    return true;
  }

  size_t fail_at = 0;  // the take that throws, counting from 1; 0: none
  size_t takes = 0, waits = 0;
  std::atomic<size_t> clobbered{0};
  std::map<size_t, uint64_t> landed;  // bytes landed per range

 private:
  struct Copy {
    LandedChunk chunk;
    std::string taken;  // the bytes when taken
  };

  void copy_loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      const Copy copy = queue_.front();
      queue_.pop_front();
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(300));
      const auto& bytes = copy.chunk.bytes;
      if (std::memcmp(bytes.data(), copy.taken.data(), bytes.size()) != 0) ++clobbered;
      std::memcpy(outs_[copy.chunk.range].data() + copy.chunk.at, bytes.data(), bytes.size());
      lock.lock();
      busy_[copy.chunk.buffer] = false;
      changed_.notify_all();
    }
  }

  Pages memory_;
  size_t size_;
  std::vector<bool> busy_;
  std::vector<std::string>& outs_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Copy> queue_;
  bool stopping_ = false;
  std::thread copier_;
};

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
    std::vector<std::string> outs{std::string(bytes.size() - 3, '\0')};
    SlowCopies pool(2, 65536, outs);
    const StagedRange staged{&file, 3, bytes.size() - 3};
    read_staged({&staged, 1}, pool, {.direct = true, .engine = engine});
    pool.drain();
    CHECK(outs[0] == bytes.substr(3));
  }
}

TEST_CASE("read_staged lands every range through a few buffers, none read into before its copy is done") {
  test::TempDir dir;
  const std::string bytes = pattern((3u << 20) + 123);  // ends inside a block
  const File file(dir.write("data.bin", bytes));
  // (offset, size): aligned, unaligned, a byte, nothing, across many buffers, up to the end.
  const std::vector<std::pair<uint64_t, uint64_t>> shapes{
      {0, 4096}, {4096, 1 << 20}, {100, 5000}, {4095, 2}, {7, 1}, {12345, 0}, {8191, 1 << 21},
      {bytes.size() - 5000, 5000}, {bytes.size() - 1, 1}, {0, bytes.size()}};
  std::vector<StagedRange> ranges;
  for (const auto& [offset, size] : shapes) ranges.push_back({&file, offset, size});
  for (const Engine engine : engines())
    for (const bool direct : {false, true})
      for (const auto& [count, size] : {std::pair<unsigned, size_t>{3, 12288}, {4, 1u << 20}, {1, 4096}}) {
        INFO("engine " << static_cast<int>(engine) << ", direct " << direct << ", " << count << " buffers of " << size);
        std::vector<std::string> outs;
        for (const auto& range : ranges) outs.emplace_back(range.size, '\xEE');
        SlowCopies pool(count, size, outs);
        read_staged(ranges, pool, {.direct = direct, .depth = 16, .engine = engine});
        pool.drain();
        CHECK(pool.clobbered == 0);
        for (size_t i = 0; i < ranges.size(); ++i) {
          INFO("range " << i);
          CHECK(pool.landed[i] == ranges[i].size);
          CHECK(outs[i] == bytes.substr(ranges[i].offset, ranges[i].size));
        }
        if (size == 12288) CHECK(pool.waits > 0);  // more chunks than buffers: the copies were waited for
      }
}

TEST_CASE("a staged read of a file cut short fails naming it, and writes no buffer once it has thrown") {
  test::TempDir dir;
  const std::string path = dir.write("cut.bin", pattern(4u << 20));
  const File file(path);
  std::filesystem::resize_file(path, (1u << 20) + 100);
  const StagedRange whole{&file, 0, 4u << 20};
  for (const Engine engine : engines())
    for (const bool direct : {false, true}) {
      INFO("engine " << static_cast<int>(engine) << ", direct " << direct);
      std::vector<std::string> outs{std::string(4u << 20, '\0')};
      SlowCopies pool(16, 65536, outs);  // 64 reads, 16 in flight, and most of them fail at once
      try {
        read_staged({&whole, 1}, pool, {.direct = direct, .depth = 16, .engine = engine});
        FAIL("a read past the end succeeded");
      } catch (const Error& error) {
        CHECK_THAT(error.what(), Catch::StartsWith(path + ": unexpected end of file at offset "));
      }
      pool.drain();
      CHECK(pool.clobbered == 0);
      const size_t takes = pool.takes;
      CHECK(pool.left_alone());
      CHECK(pool.takes == takes);
      // What landed before the end was taken as it was, and nothing else was. Which chunks landed
      // before the failure stopped the rest is the threads' and the disk's order (a read that ends
      // after the failure is dropped), but one did at least: the read past the end starts only
      // once a buffer's copy is done.
      const std::string before_the_cut = pattern(1u << 20), untouched(65536, '\0');
      size_t kept = 0;
      for (size_t at = 0; at < outs[0].size(); at += 65536) {
        INFO("the 64 KiB at " << at);
        const std::string block = outs[0].substr(at, 65536);
        if (at < before_the_cut.size() && block == before_the_cut.substr(at, 65536)) ++kept;
        else CHECK((block == untouched));
      }
      CHECK(kept > 0);
      CHECK(kept == takes);
    }
}

TEST_CASE("a take that throws stops a staged read with that error, after every read in flight") {
  test::TempDir dir;
  const std::string bytes = pattern(2u << 20);
  const File file(dir.write("data.bin", bytes));
  const StagedRange whole{&file, 0, bytes.size()};
  for (const Engine engine : engines())
    for (const bool direct : {false, true}) {
      INFO("engine " << static_cast<int>(engine) << ", direct " << direct);
      std::vector<std::string> outs{std::string(bytes.size(), '\0')};
      SlowCopies pool(8, 16384, outs);
      pool.fail_at = 5;
      CHECK_THROWS_WITH(read_staged({&whole, 1}, pool, {.direct = direct, .depth = 8, .engine = engine}),
                        "the copy was refused");
      pool.drain();
      CHECK(pool.takes == 4);
      CHECK(pool.left_alone());
      CHECK(pool.clobbered == 0);
    }
}

TEST_CASE("read_staged refuses buffers a direct read cannot fill") {
  test::TempDir dir;
  const File file(dir.write("data.bin", pattern(8192)));
  const StagedRange range{&file, 0, 8192};
  std::vector<std::string> outs{std::string(8192, '\0')};
  SlowCopies pool(2, 4096 + 512, outs);
  CHECK_THROWS_WITH(read_staged({&range, 1}, pool), "staging buffer 0 is not 4608 bytes aligned to 4096");
}
