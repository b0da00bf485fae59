// load_tensors(): many tensors in one allocation, read in large parallel chunks.
#include <sys/mman.h>

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>

#include "storage/file.hpp"
#include "storage/tensor_io.hpp"
#include "util/error.hpp"

namespace vramd::storage {
namespace {

constexpr uint64_t kBlock = File::kDirectAlignment;
constexpr uint64_t kChunk = 16u << 20;   // bytes per read
constexpr uint64_t kMaxGap = 1u << 20;   // neighbours closer than this are read together

uint64_t align_down(uint64_t value) { return value & ~(kBlock - 1); }
uint64_t align_up(uint64_t value) { return (value + kBlock - 1) & ~(kBlock - 1); }

// A stretch of one file read as a whole into the arena.
struct Run {
  uint32_t file;
  uint64_t begin, end;  // block-aligned file offsets
  uint64_t arena_offset;
};

struct Chunk {
  uint32_t file;
  uint64_t file_offset, arena_offset, size;
};

std::shared_ptr<void> map_arena(uint64_t size) {
  void* address = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (address == MAP_FAILED) throw Error("cannot allocate " + std::to_string(size) + " bytes of host memory");
  ::madvise(address, size, MADV_HUGEPAGE);  // fewer page faults while the reads fill it
  return std::shared_ptr<void>(address, [size](void* p) { ::munmap(p, size); });
}

template <typename Work>
void run_parallel(size_t count, unsigned threads, const Work& work) {
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto worker = [&] {
    for (size_t i = next++; i < count; i = next++) {
      try {
        work(i);
      } catch (...) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = count;
      }
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& thread : pool) thread.join();
  if (failure) std::rethrow_exception(failure);
}

// Converts in place of `tensors`, into one more arena: fresh memory for every output would
// cost a page fault per 4 KiB, and those dominate a conversion's time.
void convert(std::vector<at::Tensor>& tensors, c10::ScalarType dtype) {
  const uint64_t item = c10::elementSize(dtype);
  std::vector<uint64_t> offsets;
  uint64_t size = 0;
  for (const auto& tensor : tensors) {
    offsets.push_back(size);
    size += (static_cast<uint64_t>(tensor.numel()) * item + 63) / 64 * 64;
  }
  if (size == 0) {
    for (auto& tensor : tensors) tensor = tensor.to(dtype);
    return;
  }
  auto arena = map_arena(size);
  auto* base = static_cast<std::byte*>(arena.get());
  const auto options = at::TensorOptions().dtype(dtype).device(c10::kCPU);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].scalar_type() == dtype) continue;
    at::Tensor out = at::from_blob(base + offsets[i], tensors[i].sizes(), [arena](void*) {}, options);
    out.copy_(tensors[i]);
    tensors[i] = std::move(out);
  }
}

}  // namespace

std::vector<at::Tensor> load_tensors(const DiskMap& map, std::span<const TensorInfo* const> infos,
                                     const LoadOptions& options) {
  for (const auto* info : infos) scalar_type(map, *info);  // refuse before reading a byte
  std::vector<size_t> order(infos.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return infos[a]->file != infos[b]->file ? infos[a]->file < infos[b]->file : infos[a]->offset < infos[b]->offset;
  });

  std::vector<Run> runs;
  std::vector<size_t> run_of(infos.size());
  uint64_t arena_size = 0;
  for (size_t index : order) {
    const auto& info = *infos[index];
    const uint64_t end = align_up(info.offset + info.nbytes);
    if (runs.empty() || runs.back().file != info.file || info.offset > runs.back().end + kMaxGap) {
      if (!runs.empty()) arena_size += runs.back().end - runs.back().begin;
      runs.push_back(Run{info.file, align_down(info.offset), end, arena_size});
    }
    runs.back().end = std::max(runs.back().end, end);
    run_of[index] = runs.size() - 1;
  }
  if (!runs.empty()) arena_size += runs.back().end - runs.back().begin;

  std::vector<Chunk> chunks;
  for (const auto& run : runs)
    for (uint64_t at = run.begin; at < run.end; at += kChunk)
      chunks.push_back(Chunk{run.file, at, run.arena_offset + (at - run.begin), std::min(kChunk, run.end - at)});

  auto arena = arena_size ? map_arena(arena_size) : nullptr;
  auto* base = static_cast<std::byte*>(arena.get());
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const unsigned threads = options.threads ? options.threads : options.direct ? 4 : cores;
  run_parallel(chunks.size(), std::min<size_t>(threads, std::max<size_t>(chunks.size(), 1)), [&](size_t i) {
    const auto& chunk = chunks[i];
    const uint64_t file_size = map.files()[chunk.file].size;
    // Past the end of the file only with O_DIRECT, which may read whole blocks.
    const uint64_t size = options.direct ? chunk.size : std::min(chunk.size, file_size - chunk.file_offset);
    map.read_file(chunk.file, {base + chunk.arena_offset, size}, chunk.file_offset, options.direct);
  });

  std::vector<at::Tensor> tensors;
  tensors.reserve(infos.size());
  for (size_t i = 0; i < infos.size(); ++i) {
    const auto& info = *infos[i];
    const auto& run = runs[run_of[i]];
    std::byte* data = base + run.arena_offset + (info.offset - run.begin);
    const auto type = scalar_type(map, info);
    auto cpu = at::TensorOptions().dtype(type).device(c10::kCPU);
    at::Tensor tensor = at::from_blob(data, info.shape, [arena](void*) {}, cpu);
    if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(type) != 0) tensor = tensor.clone();
    tensors.push_back(std::move(tensor));
  }
  if (options.dtype) convert(tensors, *options.dtype);
  return tensors;
}

}  // namespace vramd::storage
