// ATen first: c10's logging defines a CHECK macro that Catch's must replace.
#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "storage/dequantize.hpp"
#include "storage/dequantize_ops.hpp"
#include "support/cuda.hpp"
#include "util/error.hpp"

using namespace vramd::storage;

namespace {

// Where each type keeps its float16 scales, byte offsets into a block.
struct Layout {
  DType dtype;
  std::vector<size_t> halves;
};

const Layout kLayouts[] = {
    {DType::Q4_0, {0}},     {DType::Q4_1, {0, 2}}, {DType::Q5_0, {0}},      {DType::Q5_1, {0, 2}},
    {DType::Q8_0, {0}},     {DType::Q2_K, {80, 82}}, {DType::Q3_K, {108}}, {DType::Q4_K, {0, 2}},
    {DType::Q5_K, {0, 2}},  {DType::Q6_K, {208}},
};

// Random blocks: every bit pattern of the quants, finite float16 scales of either sign (NaN
// payloads are not values to compare).
std::vector<std::byte> random_blocks(const Layout& layout, size_t blocks, std::mt19937& rng) {
  const size_t size = dtype_bits(layout.dtype) / 8;
  std::vector<std::byte> bytes(blocks * size);
  for (auto& b : bytes) b = static_cast<std::byte>(rng() & 0xff);
  std::uniform_real_distribution<float> scale(-3.0f, 3.0f);
  for (size_t i = 0; i < blocks; ++i)
    for (const size_t offset : layout.halves) {
      const auto half = at::tensor({scale(rng)}).to(at::kHalf);
      std::memcpy(&bytes[i * size + offset], half.const_data_ptr(), 2);
    }
  return bytes;
}

}  // namespace

TEST_CASE("aten unpacking equals the reference unpacker bit for bit for every block type") {
  std::mt19937 rng(7);
  for (const auto& layout : kLayouts) {
    INFO(dtype_name(layout.dtype));
    const int64_t block = dtype_block(layout.dtype), rows = 3, columns = 4 * 256;
    const auto bytes = random_blocks(layout, static_cast<size_t>(rows * columns / block), rng);
    std::vector<float> expected(static_cast<size_t>(rows * columns));
    dequantize(layout.dtype, bytes, expected);

    const auto shape = packed_shape(layout.dtype, {rows, columns});
    const at::Tensor packed = at::from_blob(const_cast<std::byte*>(bytes.data()), shape, at::kByte).clone();
    at::Tensor out = at::empty({rows, columns}, at::kFloat);
    dequantize_into(layout.dtype, packed, out);
    CHECK(std::memcmp(out.const_data_ptr(), expected.data(), expected.size() * sizeof(float)) == 0);

    // Another dtype: the float32 values rounded once.
    at::Tensor bf16 = at::empty({rows, columns}, at::kBFloat16);
    dequantize_into(layout.dtype, packed, bf16);
    CHECK(at::equal(bf16, at::from_blob(expected.data(), {rows, columns}, at::kFloat).to(at::kBFloat16)));
  }
}

TEST_CASE("aten unpacking works through tensors larger than one step") {
  std::mt19937 rng(8);
  const Layout& layout = kLayouts[4];  // Q8_0: 32-element blocks, so 2^18 elements are 8192 blocks
  const int64_t rows = 40, columns = 8192;
  const auto bytes = random_blocks(layout, static_cast<size_t>(rows * columns / 32), rng);
  std::vector<float> expected(static_cast<size_t>(rows * columns));
  dequantize(layout.dtype, bytes, expected);
  const at::Tensor packed =
      at::from_blob(const_cast<std::byte*>(bytes.data()), packed_shape(layout.dtype, {rows, columns}), at::kByte).clone();
  at::Tensor out = at::empty({rows, columns}, at::kFloat);
  dequantize_into(layout.dtype, packed, out);
  CHECK(std::memcmp(out.const_data_ptr(), expected.data(), expected.size() * sizeof(float)) == 0);
}

TEST_CASE("aten unpacking refuses bytes that do not hold the tensor") {
  const at::Tensor packed = at::zeros({2, 34}, at::kByte);  // two Q8_0 blocks
  at::Tensor out = at::empty({2, 64}, at::kFloat);
  CHECK_THROWS_WITH(dequantize_into(DType::Q8_0, packed, out),
                    "dequantize: Q8_0 bytes of shape [2, 34] on cpu do not unpack into a contiguous [2, 64] tensor on cpu");
  at::Tensor ragged = at::empty({2, 40}, at::kFloat);
  CHECK_THROWS_WITH(dequantize_into(DType::Q8_0, packed, ragged),
                    "a tensor of shape [2, 40] is not whole rows of Q8_0 blocks of 32 elements");
  at::Tensor fits = at::empty({2, 32}, at::kFloat);
  CHECK_THROWS_WITH(dequantize_into(DType::F16, packed, fits), "F16 is not a type vramd unpacks");
}

TEST_CASE("aten unpacking from the host onto a GPU carries a step's blocks at a time", "[cuda]") {
  if (!vramd::test::cuda_device_here()) return;
  const c10::Device cuda(c10::kCUDA, 0);
  auto* allocator = c10::getDeviceAllocator(c10::kCUDA);
  std::mt19937 rng(9);
  for (const auto& layout : kLayouts) {
    // 64 Mi elements, 256 steps: 32 random rows repeated, so that the packed bytes (21 MB for
    // Q2_K, the smallest) dwarf one step's scratch (a few MiB of float32).
    const int64_t rows = 32, columns = 8192, copies = 256;
    const auto bytes = random_blocks(layout, static_cast<size_t>(rows * columns / dtype_block(layout.dtype)), rng);
    const at::Tensor some =
        at::from_blob(const_cast<std::byte*>(bytes.data()), packed_shape(layout.dtype, {rows, columns}), at::kByte);
    at::Tensor packed = some.repeat({copies, 1});
    at::Tensor expected = at::empty({rows * copies, columns}, at::kBFloat16);
    dequantize_into(layout.dtype, packed, expected);
    for (const bool pinned : {false, true}) {
      INFO(dtype_name(layout.dtype) << (pinned ? ", pinned" : ""));
      if (pinned) packed = packed.pin_memory();
      at::Tensor out = at::empty({rows * copies, columns}, at::TensorOptions().dtype(at::kBFloat16).device(cuda));
      allocator->resetPeakStats(0);
      const int64_t before = allocator->getDeviceStats(0).allocated_bytes[0].current;
      dequantize_into(layout.dtype, packed, out);
      const auto stats = allocator->getDeviceStats(0).allocated_bytes[0];
      CHECK(at::equal(out.cpu(), expected));
      // Never the whole packed tensor on the device: a step's blocks and its float32 values.
      CHECK(stats.peak - before < static_cast<int64_t>(packed.nbytes() / 2));
      CHECK(stats.current == before);
    }
  }
}
