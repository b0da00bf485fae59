// ATen first: c10's logging defines a CHECK macro that Catch's must replace.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>

#include "weights/source.hpp"

using namespace vramd::weights;

namespace {

const std::byte* base_of(const at::Tensor& t) { return static_cast<const std::byte*>(t.storage().data()); }

uint64_t phase_of(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 4096; }

// Every byte of the buffer's mapping from its start, `count` of them, set to a pattern.
void fill(const at::Tensor& t, size_t count) {
  auto* bytes = static_cast<std::byte*>(t.storage().mutable_data());
  for (size_t i = 0; i < count; ++i) bytes[i] = static_cast<std::byte>(i % 251);
}

size_t kept(const at::Tensor& t, size_t count) {  // bytes of the pattern still in place, from the start
  const std::byte* bytes = base_of(t);
  size_t i = 0;
  while (i < count && bytes[i] == static_cast<std::byte>(i % 251)) ++i;
  return i;
}

}  // namespace

TEST_CASE("a CPU buffer for streamed weights begins at the phase asked for and is its storage's alone") {
  for (const uint64_t phase : {0, 2, 512, 4094}) {
    const at::Tensor t = fresh_buffer({3, 1000}, at::kBFloat16, c10::kCPU, phase);
    CHECK(t.sizes() == at::IntArrayRef({3, 1000}));
    CHECK(t.scalar_type() == at::kBFloat16);
    CHECK(t.is_contiguous());
    CHECK(phase_of(t) == phase);
    CHECK(reinterpret_cast<uintptr_t>(base_of(t)) % 4096 == 0);
    CHECK(t.storage().nbytes() >= phase + t.nbytes());
    CHECK(t.storage().use_count() == 1);  // no view holding a base: a released buffer can be reused
    t.fill_(1.5);
    CHECK(t.eq(1.5).all().item<bool>());
  }
}

TEST_CASE("a spare buffer refitted to another size and phase keeps the pages both need") {
  const size_t big = 6 << 20, small = 2 << 20;
  at::Tensor spare = fresh_buffer({static_cast<int64_t>(big / 2)}, at::kBFloat16, c10::kCPU, 0);
  fill(spare, big);

  SECTION("smaller, at another phase") {
    const at::Tensor t = refit_buffer(std::move(spare), {1024, 1024}, at::kBFloat16, 1024);
    CHECK(phase_of(t) == 1024);
    CHECK(t.nbytes() == small);
    CHECK(t.storage().nbytes() >= 1024 + small);
    CHECK(kept(t, 1024 + small) == 1024 + small);  // moved, not a fresh mapping (which the kernel zeroes)
    CHECK(t.storage().use_count() == 1);
  }
  SECTION("larger, in another dtype") {
    const at::Tensor t = refit_buffer(std::move(spare), {static_cast<int64_t>(big / 2)}, at::kFloat, 8);
    CHECK(phase_of(t) == 8);
    CHECK(t.nbytes() == 2 * big);
    CHECK(kept(t, big) == big);
    const auto* bytes = base_of(t);
    size_t zeros = 0;
    for (size_t i = big + 4096; i < 2 * big; ++i) zeros += bytes[i] == std::byte{0};
    CHECK(zeros == big - 4096);  // the pages it grew by are new
    t.fill_(2.0f);
    CHECK(t.sum().item<double>() == static_cast<double>(big));
  }
  SECTION("the same size: placed at the new phase without a new mapping") {
    const std::byte* before = base_of(spare);
    const at::Tensor t = refit_buffer(std::move(spare), {static_cast<int64_t>(big / 2)}, at::kBFloat16, 4000);
    CHECK(base_of(t) == before);
    CHECK(phase_of(t) == 4000);
    CHECK(kept(t, big) == big);
  }
}

TEST_CASE("a buffer someone else holds, or that is not fresh_buffer's, is never refitted") {
  SECTION("held elsewhere: the holder keeps its bytes") {
    const at::Tensor spare = fresh_buffer({4096}, at::kByte, c10::kCPU, 0);
    spare.fill_(7);
    const at::Tensor t = refit_buffer(spare, {8192}, at::kByte, 0);
    CHECK(base_of(t) != base_of(spare));
    CHECK(spare.sum().item<int64_t>() == 7 * 4096);
    CHECK(t.nbytes() == 8192);
  }
  SECTION("a view of a buffer: its storage is not the view's alone") {
    at::Tensor whole = fresh_buffer({2, 4096}, at::kByte, c10::kCPU, 0);
    whole.fill_(3);
    const at::Tensor t = refit_buffer(whole[1], {100}, at::kByte, 0);
    CHECK(whole.sum().item<int64_t>() == 3 * 8192);
    CHECK(t.nbytes() == 100);
  }
  SECTION("memory of LibTorch's allocator") {
    at::Tensor other = at::ones({1000}, at::kFloat);
    const at::Tensor t = refit_buffer(std::move(other), {1000}, at::kFloat, 4);
    CHECK(phase_of(t) == 4);
    CHECK(t.nbytes() == 4000);
  }
}
