// load_tensors(): many tensors in one allocation, read with many reads in flight.
#include <sys/mman.h>

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <numeric>

#include "storage/file.hpp"
#include "storage/tensor_io.hpp"
#include "util/error.hpp"

namespace vramd::storage {
namespace {

constexpr uint64_t kMaxGap = 1u << 20;   // neighbours closer than this are read together

// A stretch of one file read as a whole into the arena.
struct Run {
  uint32_t file;
  uint64_t begin, end;  // block-aligned file offsets
  uint64_t arena_offset;
};

std::shared_ptr<void> map_arena(uint64_t size) {
  void* address = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (address == MAP_FAILED) throw Error("cannot allocate " + std::to_string(size) + " bytes of host memory");
  ::madvise(address, size, MADV_HUGEPAGE);  // fewer page faults while the reads fill it
  return std::shared_ptr<void>(address, [size](void* p) { ::munmap(p, size); });
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
  for (const auto* info : infos)  // refuse before reading a byte
    if (dtype_block(info->dtype) == 1) scalar_type(map, *info);
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
    const uint64_t end = File::align_up(info.offset + info.nbytes);
    if (runs.empty() || runs.back().file != info.file || info.offset > runs.back().end + kMaxGap) {
      if (!runs.empty()) arena_size += runs.back().end - runs.back().begin;
      runs.push_back(Run{info.file, File::align_down(info.offset), end, arena_size});
    }
    runs.back().end = std::max(runs.back().end, end);
    run_of[index] = runs.size() - 1;
  }
  if (!runs.empty()) arena_size += runs.back().end - runs.back().begin;

  auto arena = arena_size ? map_arena(arena_size) : nullptr;
  auto* base = static_cast<std::byte*>(arena.get());
  std::vector<DiskMap::Range> reads;
  for (const auto& run : runs) {
    const uint64_t size = std::min(run.end, map.files()[run.file].size) - run.begin;
    reads.push_back({run.file, run.begin, {base + run.arena_offset, size}});
  }
  ReaderOptions read_options{.direct = options.direct};
  if (options.threads) read_options.depth = options.threads;
  map.read_ranges(reads, read_options);

  std::vector<at::Tensor> tensors;
  tensors.reserve(infos.size());
  for (size_t i = 0; i < infos.size(); ++i) {
    const auto& info = *infos[i];
    const auto& run = runs[run_of[i]];
    std::byte* data = base + run.arena_offset + (info.offset - run.begin);
    if (dtype_block(info.dtype) != 1) {
      tensors.push_back(unpacked(map, info, {data, info.nbytes}));
      continue;
    }
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
