// The vramd side of bench/storage.py: times DiskMap and tensor reads in-process and prints one
// JSON object per command. Not a test; see docs/benchmarks.md.
//
//   vramd_bench_storage index PATH REPEAT
//   vramd_bench_storage read PATH REPEAT MODE [f32]
//     MODE: copy | view | direct (one tensor at a time, load_tensor)
//           bulk | bulk-direct   (all at once, load_tensors)
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "storage/disk_map.hpp"
#include "storage/tensor_io.hpp"

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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s index PATH REPEAT | read PATH REPEAT MODE [f32]\n", argv[0]);
    return 2;
  }
  const std::string command = argv[1], path = argv[2];
  const int repeat = std::stoi(argv[3]);
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
      if (mode.starts_with("bulk")) {
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
      tensors = loaded.size();
      bytes = 0;
      for (const auto& tensor : loaded) bytes += tensor.nbytes();
    }
  }
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  std::printf("{\"seconds\": [");
  for (size_t i = 0; i < times.size(); ++i) std::printf("%s%.6f", i ? ", " : "", times[i]);
  std::printf("], \"tensors\": %llu, \"bytes\": %llu, \"max_rss_kib\": %ld, \"checksum\": %llu}\n",
              static_cast<unsigned long long>(tensors), static_cast<unsigned long long>(bytes), usage.ru_maxrss,
              static_cast<unsigned long long>(checksum));
  return 0;
}
