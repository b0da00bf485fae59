#include <catch2/catch.hpp>

#include <filesystem>
#include <vector>

#include "convert/expr.hpp"
#include "storage/disk_map.hpp"
#include "storage/safetensors_writer.hpp"
#include "support/temp_dir.hpp"
#include "weights/copy_key.hpp"

using namespace vramd;
using vramd::test::TempDir;

namespace {

std::string write_model(const std::string& path, float first) {
  static std::vector<float> a(16), b(16);
  for (size_t i = 0; i < a.size(); ++i) a[i] = first + static_cast<float>(i), b[i] = -a[i];
  auto bytes = [](const std::vector<float>& v) {
    return std::span<const std::byte>(reinterpret_cast<const std::byte*>(v.data()), v.size() * 4);
  };
  const std::vector<storage::TensorData> tensors = {{"a", storage::DType::F32, {4, 4}, bytes(a)},
                                                    {"b", storage::DType::F32, {4, 4}, bytes(b)}};
  storage::write_safetensors(path, tensors);
  return path;
}

convert::ExprPtr a() { return convert::source("a", storage::DType::F32, {4, 4}); }

}  // namespace

TEST_CASE("copy keys name every operation, the tensors read and the file they lie in") {
  TempDir dir;
  const auto map = storage::DiskMap::open(write_model(dir / "model.safetensors", 1));
  weights::CopyKeys keys(map), again(map);
  const std::string plain = keys(*a(), "BFloat16", "cpu");
  CHECK(again(*a(), "BFloat16", "cpu") == plain);  // equal expressions of one file: one key
  CHECK(keys(*a(), "Half", "cpu") != plain);
  CHECK(keys(*a(), "BFloat16", "cuda:0") != plain);
  CHECK(keys(*convert::source("b", storage::DType::F32, {4, 4}), "BFloat16", "cpu") != plain);
  CHECK(keys(*convert::scale(a(), 2), "BFloat16", "cpu") != keys(*convert::scale(a(), 3), "BFloat16", "cpu"));
  CHECK(keys(*convert::transpose(a(), 0, 1), "BFloat16", "cpu") != plain);
  CHECK(keys(*convert::narrow(a(), 0, 0, 2), "BFloat16", "cpu") != keys(*convert::narrow(a(), 0, 2, 2), "BFloat16", "cpu"));

  SECTION("another file with the same bytes, or the file written again, is another key") {
    std::filesystem::copy_file(dir / "model.safetensors", dir / "copy.safetensors");
    const auto copy = storage::DiskMap::open(dir / "copy.safetensors");
    CHECK(weights::CopyKeys(copy)(*a(), "BFloat16", "cpu") != plain);
    const auto rewritten = storage::DiskMap::open(write_model(dir / "model.safetensors", 2));  // renamed into place
    CHECK(weights::CopyKeys(rewritten)(*a(), "BFloat16", "cpu") != plain);
  }

  SECTION("spans of copies are named apart from files' pages, one per key") {
    CHECK(weights::copy_span(plain).starts_with(weights::kCopySpan));
    CHECK(weights::copy_span(plain) == weights::copy_span(again(*a(), "BFloat16", "cpu")));
    CHECK(weights::copy_span(plain) != weights::copy_span(keys(*a(), "Half", "cpu")));
  }
}
