// The vramd side of bench/storage.py: times DiskMap and tensor reads in-process and prints one
// JSON object per command. Not a test; see docs/benchmarks.md.
//
//   vramd_bench_storage index PATH REPEAT
//   vramd_bench_storage read PATH REPEAT MODE [f32]
//     MODE: copy | view | direct (one tensor at a time, load_tensor)
//           bulk | bulk-direct   (all at once, load_tensors)
//           staged-direct        (all at once through DeviceStaging's 16 buffers of 8 MiB, the
//                                 reads a GPU gets, each chunk copied out on the CPU into
//                                 memory faulted in before the clock starts, as a device's is)
//           staged-cuda | staged-cuda-pinned
//                                (the same onto cuda:0, the clock stopped once the copies are
//                                 done, through huge pages registered with the driver or
//                                 LibTorch's pinned memory; "host_memory" says which it got)
//           staged-pages | staged-huge
//                                (the reads alone: read_staged into 16 buffers of 8 MiB, faulted
//                                 in before the clock starts, of 4 KiB pages, as LibTorch's
//                                 pinned memory is, or of huge pages; nothing copied out)
//           fault-huge | fault-pages
//                                (no read: fresh memory of the checkpoint's size faulted in,
//                                 of huge pages as load_tensors' arena is, or of 4 KiB pages)
#include <ATen/ops/zeros.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "storage/device_staging.hpp"
#include "storage/disk_map.hpp"
#include "storage/tensor_io.hpp"
#include "util/exit.hpp"
#include "util/torch_cuda.hpp"

using namespace vramd::storage;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Touches one byte per page so that lazily mapped views are really in memory.
uint64_t touch(const at::Tensor& tensor) {
  const auto* bytes = static_cast<const volatile uint8_t*>(tensor.const_data_ptr());
  uint64_t sum = 0;
  for (size_t i = 0; i < tensor.nbytes(); i += 4096) sum += bytes[i];
  return sum;
}

// Buffers whose chunks go nowhere: what read_staged alone reaches into memory of either page size.
class DiscardingPool final : public StagingPool {
 public:
  static constexpr unsigned kCount = 16;
  static constexpr uint64_t kBytes = 8u << 20;
  explicit DiscardingPool(bool huge)
      : memory_(static_cast<std::byte*>(mmap(nullptr, kCount * kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0))) {
    if (memory_ == MAP_FAILED) throw std::runtime_error("mmap failed");
    ::madvise(memory_, kCount * kBytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    std::memset(memory_, 0, kCount * kBytes);
  }
  ~DiscardingPool() override { ::munmap(memory_, kCount * kBytes); }
  unsigned count() const override { return kCount; }
  std::span<std::byte> buffer(unsigned i) override { return {memory_ + i * kBytes, kBytes}; }
  void take(const LandedChunk&) override {}
  bool done(unsigned) override { return true; }
  void wait(unsigned) override {}

 private:
  std::byte* memory_;
};

}  // namespace

int run(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s index PATH REPEAT | read PATH REPEAT MODE [f32]\n", argv[0]);
    return 2;
  }
  vramd::torch_cuda::load();  // where a CUDA driver is, for the staged-cuda modes
  const std::string command = argv[1], path = argv[2];
  const int repeat = std::stoi(argv[3]);
  std::string host_memory;
  std::vector<double> times;
  uint64_t tensors = 0, bytes = 0, checksum = 0;
  for (int i = 0; i < repeat; ++i) {
    if (command == "index") {
      auto start = Clock::now();
      auto map = DiskMap::open(path);
      times.push_back(seconds_since(start));
      tensors = map.tensors().size();
    } else {
      const std::string mode = argc > 4 ? argv[4] : "copy";
      const bool f32 = argc > 5 && std::strcmp(argv[5], "f32") == 0;
      ReadOptions options;
      options.mode = mode == "direct" ? ReadMode::Direct : mode == "view" ? ReadMode::Auto : ReadMode::Copy;
      if (f32) options.dtype = at::kFloat;
      auto start = Clock::now();
      auto map = DiskMap::open(path);
      std::vector<at::Tensor> loaded;
      if (mode == "fault-huge" || mode == "fault-pages") {
        const uint64_t size = map.total_bytes();
        void* memory = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (memory == MAP_FAILED) throw std::runtime_error("mmap failed");
        ::madvise(memory, size, mode == "fault-huge" ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        start = Clock::now();
        if (::madvise(memory, size, 23 /* MADV_POPULATE_WRITE, Linux 5.14 */) != 0) std::memset(memory, 0, size);
        times.push_back(seconds_since(start));
        ::munmap(memory, size);
        bytes = size;
        continue;
      }
      if (mode == "staged-pages" || mode == "staged-huge") {
        DiscardingPool pool(mode == "staged-huge");
        std::vector<DiskMap::Staged> ranges;
        for (const auto& info : map.tensors()) ranges.push_back({info.file, info.offset, info.nbytes});
        start = Clock::now();
        map.read_staged(ranges, pool, {.direct = true, .depth = DiscardingPool::kCount});
        tensors = ranges.size();
        bytes = map.total_bytes();
      } else if (mode == "staged-direct" || mode.starts_with("staged-cuda")) {
        // The targets (on the CPU, faulted in) and the staging buffers are made before the clock starts.
        const c10::Device device = mode == "staged-direct" ? c10::Device(c10::kCPU) : c10::Device(c10::kCUDA, 0);
        DeviceStaging staging(device, DeviceStaging::kBuffers, DeviceStaging::kBufferBytes,
                              mode == "staged-cuda-pinned" ? DeviceStaging::HostMemory::TorchPinned
                                                           : DeviceStaging::HostMemory::Registered);
        std::vector<DeviceStaging::Target> targets;
        for (const auto& info : map.tensors())
          targets.push_back({info.file, info.offset,
                             at::zeros(info.shape, at::TensorOptions().device(device).dtype(scalar_type(map, info)))});
        if (!targets.empty()) staging.read(map, {targets.data(), 1}, true);  // its buffers made before the clock
        start = Clock::now();
        staging.read(map, targets, true);
        if (device.is_cuda()) c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
        host_memory = staging.host_memory();
        for (auto& target : targets) loaded.push_back(std::move(target.out));
      } else if (mode.starts_with("bulk")) {
        std::vector<const TensorInfo*> infos;
        for (const auto& info : map.tensors()) infos.push_back(&info);
        LoadOptions bulk;
        bulk.direct = mode == "bulk-direct";
        if (f32) bulk.dtype = at::kFloat;
        loaded = load_tensors(map, infos, bulk);
      } else {
        loaded.reserve(map.tensors().size());
        for (const auto& info : map.tensors()) loaded.push_back(load_tensor(map, info, options));
      }
      if (options.mode == ReadMode::Auto)
        for (const auto& tensor : loaded) checksum += touch(tensor);
      times.push_back(seconds_since(start));
      if (loaded.empty()) continue;  // the staged reads alone counted theirs
      tensors = loaded.size();
      bytes = 0;
      for (const auto& tensor : loaded) bytes += tensor.nbytes();
    }
  }
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  std::printf("{\"seconds\": [");
  for (size_t i = 0; i < times.size(); ++i) std::printf("%s%.6f", i ? ", " : "", times[i]);
  std::printf("], \"tensors\": %llu, \"bytes\": %llu, \"max_rss_kib\": %ld, \"checksum\": %llu",
              static_cast<unsigned long long>(tensors), static_cast<unsigned long long>(bytes), usage.ru_maxrss,
              static_cast<unsigned long long>(checksum));
  if (!host_memory.empty()) std::printf(", \"host_memory\": \"%s\"", host_memory.c_str());
  std::printf("}\n");
  return 0;
}

namespace {

int bench_main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // c10::Error's what() carries a backtrace: its first line says it
    const std::string what = e.what();
    std::fprintf(stderr, "%s: %s\n", argv[0], what.substr(0, what.find('\n')).c_str());
    return 1;
  }
}

}  // namespace

// Ends as vramd does, without LibTorch's teardown (util/exit.hpp).
int main(int argc, char** argv) { vramd::exit_without_destructors(bench_main(argc, argv)); }
