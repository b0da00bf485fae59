// The vramd side of bench/convert.py: times a converter run over a checkpoint's index
// (DiskMap::open excluded) and prints one JSON object. Not a test; see docs/benchmarks.md.
//
//   vramd_bench_convert SCRIPT CHECKPOINT REPEAT
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "convert/converter.hpp"
#include "storage/disk_map.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s SCRIPT CHECKPOINT REPEAT\n", argv[0]);
    return 2;
  }
  auto map = vramd::storage::DiskMap::open(argv[2]);
  std::vector<double> times;
  size_t targets = 0;
  for (int i = 0, repeat = std::stoi(argv[3]); i < repeat; ++i) {
    auto start = std::chrono::steady_clock::now();
    auto plan = vramd::convert::run_converter(argv[1], map);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    targets = plan.tensors.size();
  }
  std::printf("{\"seconds\": [");
  for (size_t i = 0; i < times.size(); ++i) std::printf("%s%.6f", i ? ", " : "", times[i]);
  std::printf("], \"sources\": %zu, \"targets\": %zu}\n", map.tensors().size(), targets);
  return 0;
}
