// ATen first: c10's logging defines a CHECK macro that Catch's must replace.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <catch2/catch.hpp>

#include <optional>
#include <string>
#include <vector>

#include "storage/device_staging.hpp"
#include "storage/tensor_io.hpp"
#include "support/cuda.hpp"
#include "support/temp_dir.hpp"

using namespace vramd::storage;
using vramd::test::TempDir;

namespace {

// Tensors of many sizes, dtypes and offsets in their file: a byte first, so that what follows
// lies off every alignment, and several larger than the buffers of the tests below.
std::string checkpoint(const TempDir& dir) {
  at::manual_seed(3);
  const auto path = dir / "odd.safetensors";
  save_tensors(path, {{"a.byte", at::full({1}, 7, at::kByte)},
                      {"b.small", at::randn({3, 5})},
                      {"c.large", at::randn({700, 333}).to(at::kBFloat16)},
                      {"d.ints", at::arange(9999, at::kLong)},
                      {"e.half", at::randn({12289}).to(at::kHalf)},
                      {"f.empty", at::empty({0, 4})},
                      {"g.tail", at::randn({64 * 1024 + 3})}});
  return path;
}

// Reads every tensor of the map through `staging` onto `device` and checks each against
// load_tensor's copy on the CPU, twice: the second read reuses the buffers. With `inference`,
// the targets are made and read into under c10::InferenceMode, as on a forward's thread, while
// the buffered reads land on the reader's threads, which are not.
void check_reads(DeviceStaging& staging, const DiskMap& map, c10::Device device, bool direct, bool inference = false) {
  for (int round = 0; round < 2; ++round) {
    std::optional<c10::InferenceMode> mode;
    if (inference) mode.emplace();
    std::vector<DeviceStaging::Target> targets;
    for (const auto& info : map.tensors()) {
      targets.push_back({info.file, info.offset,
                         at::full(info.shape, 0x55, at::TensorOptions().device(device).dtype(scalar_type(map, info)))});
    }
    staging.read(map, targets, direct);
    if (!device.is_cpu()) c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
    for (size_t i = 0; i < targets.size(); ++i) {
      const auto& info = map.tensors()[i];
      INFO("round " << round << ", direct " << direct << ", " << info.name());
      CHECK(at::equal(targets[i].out.cpu(), load_tensor(map, info)));
    }
  }
}

// Copies host tensors of many sizes and dtypes (views of one buffer, at odd offsets) through
// `staging` onto `device` and checks each, twice: the second copy reuses the buffers.
void check_copies(DeviceStaging& staging, c10::Device device) {
  at::manual_seed(5);
  const at::Tensor host = at::randint(0, 256, {3 * 65536 + 16}, at::kByte);
  const std::vector<std::pair<int64_t, int64_t>> spans{{1, 7}, {8, 65536}, {65544, 2 * 65536 + 5}, {3 * 65536 + 13, 1}, {0, 0}};
  for (int round = 0; round < 2; ++round) {
    std::vector<DeviceStaging::HostCopy> copies;
    for (const auto& [at, n] : spans)
      copies.push_back({{static_cast<const std::byte*>(host.const_data_ptr()) + at, static_cast<size_t>(n)},
                        at::full({n}, 0x55, at::TensorOptions().device(device).dtype(at::kByte))});
    staging.copy(copies);
    if (!device.is_cpu()) c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
    for (size_t i = 0; i < spans.size(); ++i) {
      INFO("round " << round << ", bytes " << spans[i].first << " to " << spans[i].first + spans[i].second);
      CHECK(at::equal(copies[i].out.cpu(), host.narrow(0, spans[i].first, spans[i].second)));
    }
  }
}

}  // namespace

TEST_CASE("DeviceStaging copies host memory through fewer buffers than chunks") {
  DeviceStaging staging(c10::kCPU, 3, 65536);
  check_copies(staging, c10::kCPU);
  CHECK(staging.host_bytes() == 3 * 65536);
  {  // chunks of several MiB, each copied into its buffer on several threads
    DeviceStaging large(c10::kCPU, 2, 4 << 20);
    const at::Tensor host = at::randint(0, 256, {(9 << 20) + 3}, at::kByte);
    const DeviceStaging::HostCopy whole{{static_cast<const std::byte*>(host.const_data_ptr()), host.nbytes()},
                                        at::zeros_like(host)};
    large.copy({&whole, 1});
    CHECK(at::equal(whole.out, host));
  }
  // A reading after copying, through the same buffers.
  TempDir dir;
  const auto map = DiskMap::open(checkpoint(dir));
  check_reads(staging, map, c10::kCPU, false);
  const std::vector<std::byte> bytes(16);
  const DeviceStaging::HostCopy longer{bytes, at::empty({15}, at::kByte)};
  CHECK_THROWS_WITH(staging.copy({&longer, 1}), "a staged copy of 16 B into a tensor of 15 B");
  const DeviceStaging::HostCopy transposed{{bytes.data(), 15 * 4}, at::empty({5, 3}).t()};
  CHECK_THROWS_WITH(staging.copy({&transposed, 1}), "a staged copy's target must be a contiguous tensor on cpu");
}

TEST_CASE("DeviceStaging reads tensors at any offset through fewer buffers than chunks") {
  TempDir dir;
  const auto map = DiskMap::open(checkpoint(dir));
  for (const bool direct : {false, true}) {
    DeviceStaging staging(c10::kCPU, 3, 65536);
    CHECK(staging.host_bytes() == 0);
    CHECK(staging.host_memory() == "none");
    check_reads(staging, map, c10::kCPU, direct);
    CHECK(staging.host_bytes() == 3 * 65536);
    CHECK(staging.host_memory() == "huge pages");
  }
}

// A streamed model's forward reads a layer itself when the prefetch thread has not: under
// c10::InferenceMode, into targets made under it, while the chunks land on the reader's threads,
// which are not in that mode, through buffers the prefetch thread made in none. The copies out of
// the buffers must be allowed on any thread: 8 MiB in 4 KiB chunks, so that the reader's other
// threads take some even on two cores.
TEST_CASE("DeviceStaging reads for a thread in inference mode through buffers made outside it") {
  TempDir dir;
  const auto path = dir / "big.safetensors";
  save_tensors(path, {{"a.byte", at::full({1}, 7, at::kByte)}, {"b.big", at::randn({2 << 20})}});
  const auto map = DiskMap::open(path);
  DeviceStaging staging(c10::kCPU, 4, 4096);
  check_reads(staging, map, c10::kCPU, false);  // the buffers made by a thread in no mode
  check_reads(staging, map, c10::kCPU, false, /*inference=*/true);
}

TEST_CASE("DeviceStaging refuses a target that is not a contiguous tensor on its device") {
  TempDir dir;
  const auto map = DiskMap::open(checkpoint(dir));
  const auto& info = *map.find("b.small");
  DeviceStaging staging(c10::kCPU);
  const DeviceStaging::Target transposed{info.file, info.offset, at::empty({5, 3}).t()};
  CHECK_THROWS_WITH(staging.read(map, {&transposed, 1}, false),
                    "a staged read's target must be a contiguous tensor on cpu");
}

TEST_CASE("DeviceStaging reads and copies onto a GPU through registered huge pages or pinned memory", "[cuda]") {
  if (!vramd::test::cuda_device_here()) return;
  TempDir dir;
  const auto map = DiskMap::open(checkpoint(dir));
  const c10::Device cuda(c10::kCUDA, 0);
  using Memory = DeviceStaging::HostMemory;
  for (const auto memory : {Memory::Registered, Memory::TorchPinned}) {
    for (const bool direct : {false, true}) {
      DeviceStaging staging(cuda, 3, 65536, memory);
      check_reads(staging, map, cuda, direct);
      check_reads(staging, map, cuda, direct, /*inference=*/true);
      // A refused registration falls back to pinned memory: here it must not have been refused.
      CHECK(staging.host_memory() ==
            (memory == Memory::Registered ? "huge pages registered with the CUDA driver" : "LibTorch's pinned memory"));
    }
  }
  for (const auto memory : {Memory::Registered, Memory::TorchPinned}) {  // host memory copied across
    DeviceStaging staging(cuda, 3, 65536, memory);
    check_copies(staging, cuda);
    const c10::InferenceMode mode;  // an update's targets may be a forward's inference tensors
    check_copies(staging, cuda);
  }
  // The defaults, on a stream of the pool's: what the prefetch thread does.
  DeviceStaging staging(cuda);
  const c10::impl::VirtualGuardImpl guard(c10::kCUDA);
  const c10::Stream side = guard.getStreamFromGlobalPool(cuda);
  const c10::Stream before = guard.exchangeStream(side);
  check_reads(staging, map, cuda, true);
  guard.exchangeStream(before);
}
