// ATen first: c10's logging defines a CHECK macro that Catch's must replace.
#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "storage/tensor_io.hpp"
#include "support/cuda.hpp"
#include "support/temp_dir.hpp"
#include "util/error.hpp"

using namespace vramd::storage;
using vramd::test::TempDir;

namespace {

std::string file_bytes(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return out + json + data;
}

// A byte "b" = 7, then "w" = {1.5, -2.25} in float32 at offset 1 of the data: misaligned.
std::string misaligned_file(const TempDir& dir) {
  float values[2] = {1.5f, -2.25f};
  std::string data = "\x07" + std::string(reinterpret_cast<char*>(values), 8);
  return dir.write("odd.safetensors", file_bytes(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                                 R"("w":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})", data));
}

// Mappings of `path` in this process, from /proc/self/maps.
int mappings_of(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) n += line.ends_with(" " + path);
  return n;
}

bool inside(const at::Tensor& tensor, std::span<std::byte> bytes) {
  auto* p = static_cast<const std::byte*>(tensor.const_data_ptr());
  return p >= bytes.data() && p < bytes.data() + bytes.size();
}

}  // namespace

TEST_CASE("aligned tensors load as zero-copy views that keep the file mapped") {
  TempDir dir;
  auto path = dir / "m.safetensors";
  save_tensors(path, {{"w", at::arange(12, at::kFloat).reshape({3, 4})}});
  at::Tensor view;
  {
    auto map = DiskMap::open(path);
    view = load_tensor(map, "w");
    CHECK(inside(view, map.bytes(map.at("w")).first));
  }
  CHECK(view.sizes() == at::IntArrayRef({3, 4}));
  CHECK(at::equal(view, at::arange(12, at::kFloat).reshape({3, 4})));  // the map is gone, the view lives

  view.fill_(7);  // private: the file keeps its bytes
  auto again = DiskMap::open(path);
  CHECK(at::equal(load_tensor(again, "w"), at::arange(12, at::kFloat).reshape({3, 4})));
}

TEST_CASE("misaligned tensors are copied and every read mode returns the same values") {
  TempDir dir;
  auto path = misaligned_file(dir);
  auto map = DiskMap::open(path);
  const auto expected = at::tensor({1.5f, -2.25f});
  for (auto mode : {ReadMode::Auto, ReadMode::Copy, ReadMode::Direct}) {
    auto w = load_tensor(map, "w", {std::nullopt, mode});
    CHECK(reinterpret_cast<uintptr_t>(w.const_data_ptr()) % 4 == 0);
    CHECK(!inside(w, map.bytes(map.at("w")).first));
    CHECK(at::equal(w, expected));
  }
  CHECK(load_tensor(map, "b").item<uint8_t>() == 7);
}

TEST_CASE("map_tensor views one tensor in a read-only mapping of its own that goes with the tensor") {
  TempDir dir;
  const auto path = dir / "m.safetensors";
  const auto weight = at::arange(5000, at::kFloat).reshape({50, 100});  // pages, not at a page's start
  save_tensors(path, {{"a", at::ones({3}, at::kShort)}, {"w", weight}});
  auto map = DiskMap::open(path);
  const auto whole = map.bytes(map.at("w")).first;  // the file's own mapping, made here
  const int before = mappings_of(path);
  at::Tensor view = map_tensor(map, map.at("w"));
  REQUIRE(view.defined());
  CHECK(is_mapped_view(view));
  CHECK(!is_mapped_view(load_tensor(map, "w", {std::nullopt, ReadMode::Copy})));
  CHECK(!is_mapped_view(at::Tensor()));
  CHECK(!inside(view, whole));
  CHECK(at::equal(view, weight));
  CHECK(mappings_of(path) == before + 1);
  view.reset();
  CHECK(mappings_of(path) == before);  // unmapped with the tensor

  SECTION("a file cut short after indexing is refused, naming it") {
    std::filesystem::resize_file(path, 200);
    CHECK_THROWS_WITH(map_tensor(map, map.at("w")),
                      Catch::Contains(path) && Catch::Contains("too short for bytes"));
  }
}

TEST_CASE("map_tensor leaves data not aligned to its dtype to the readers") {
  TempDir dir;
  auto path = misaligned_file(dir);
  auto map = DiskMap::open(path);
  CHECK(!map_tensor(map, map.at("w")).defined());
  CHECK(map_tensor(map, map.at("b")).item<uint8_t>() == 7);
}

TEST_CASE("a requested dtype converts at read time") {
  TempDir dir;
  auto path = dir / "bf16.safetensors";
  auto source = at::randn({64, 32}).to(at::kBFloat16);
  save_tensors(path, {{"w", source}});
  auto map = DiskMap::open(path);
  for (auto mode : {ReadMode::Auto, ReadMode::Copy}) {
    auto w = load_tensor(map, "w", {at::kFloat, mode});
    CHECK(w.scalar_type() == at::kFloat);
    CHECK(at::equal(w, source.to(at::kFloat)));
  }
}

TEST_CASE("every dtype LibTorch has round-trips through the writer and the reader") {
  TempDir dir;
  NamedTensors tensors;
  for (auto type : {at::kBool, at::kByte, at::kChar, at::kShort, at::kUInt16, at::kInt, at::kUInt32, at::kLong,
                    at::kUInt64, at::kHalf, at::kBFloat16, at::kFloat, at::kDouble, at::kComplexFloat,
                    at::ScalarType::Float8_e4m3fn, at::ScalarType::Float8_e5m2, at::ScalarType::Float8_e8m0fnu})
    tensors.emplace_back(c10::toString(type), at::arange(6, at::kFloat).reshape({2, 3}).to(type));
  tensors.emplace_back("strided", at::arange(12, at::kFloat).reshape({3, 4}).t());
  save_tensors(dir / "all.safetensors", tensors);
  auto map = DiskMap::open(dir / "all.safetensors");
  for (const auto& [name, tensor] : tensors) {
    INFO(name);
    auto loaded = load_tensor(map, name);
    CHECK(loaded.scalar_type() == tensor.scalar_type());
    CHECK(at::equal(loaded.to(at::kDouble), tensor.to(at::kDouble)));
  }
}

TEST_CASE("a dtype LibTorch lacks is indexed but refused at read time with the file and tensor named") {
  TempDir dir;
  auto path = dir.write("f4.safetensors", file_bytes(R"({"w":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}})", "ab"));
  auto map = DiskMap::open(path);
  CHECK(map.at("w").nbytes == 2);
  CHECK_THROWS_WITH(load_tensor(map, "w"), path + ": tensor 'w': dtype F4 has no LibTorch equivalent");
}

TEST_CASE("files written here read back in the reference safetensors package and the other way round") {
  const std::string python = VRAMD_PYTHON;
  if (python.empty()) {
    WARN("skipped: no Python with safetensors configured (VRAMD_PYTHON)");
    return;
  }
  TempDir dir;
  const std::string script = std::string(VRAMD_SOURCE_DIR) + "/tests/storage/reference_files.py";

  NamedTensors ours;
  for (auto type : {at::kFloat, at::kBFloat16, at::kHalf, at::kLong, at::ScalarType::Float8_e4m3fn})
    ours.emplace_back(c10::toString(type), at::arange(24, at::kFloat).reshape({2, 3, 4}).to(type));
  save_tensors(dir / "ours.safetensors", ours, {{"made_by", "vramd"}});
  CHECK(std::system((python + " " + script + " check " + dir / "ours.safetensors").c_str()) == 0);

  REQUIRE(std::system((python + " " + script + " write " + dir / "theirs.safetensors").c_str()) == 0);
  auto map = DiskMap::open(dir / "theirs.safetensors");
  CHECK(map.tensors().size() >= 10);
  for (const auto& info : map.tensors()) {
    INFO(info.key);
    auto loaded = load_tensor(map, info);
    auto expected = at::arange(static_cast<int64_t>(info.elements()), at::kFloat).reshape(info.shape);
    CHECK(at::equal(loaded.to(at::kFloat), expected.to(loaded.scalar_type()).to(at::kFloat)));
  }
}

TEST_CASE("a torch.save state dict is read lazily with views and tied names") {
  const std::string python = VRAMD_PYTHON;
  if (python.empty()) {
    WARN("skipped: no Python with torch configured (VRAMD_PYTHON)");
    return;
  }
  TempDir dir;
  const std::string script = std::string(VRAMD_SOURCE_DIR) + "/tests/storage/reference_files.py";
  REQUIRE(std::system((python + " " + script + " write-pickle " + dir / "model.bin").c_str()) == 0);
  auto map = DiskMap::open(dir / "model.bin");
  CHECK(map.files()[0].format == FileFormat::TorchPickle);
  CHECK(map.tensors().size() == 7);
  for (const char* name : {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "tied"}) {
    INFO(name);
    auto tensor = load_tensor(map, name);
    auto expected = at::arange(tensor.numel(), at::kFloat).reshape(tensor.sizes());
    CHECK(at::equal(tensor.to(at::kFloat), expected));
  }
  CHECK(load_tensor(map, "2.weight").scalar_type() == at::kBFloat16);
  CHECK(at::equal(load_tensor(map, "row"), at::tensor({4.0f, 5.0f, 6.0f, 7.0f})));
  CHECK(map.at("tied").offset == map.at("0.weight").offset);
}

TEST_CASE("load_tensors reads many tensors at once from several files and skips what is not asked for") {
  TempDir dir;
  NamedTensors first, second;
  for (int i = 0; i < 6; ++i)
    first.emplace_back("a." + std::to_string(i), at::arange(1000 * (i + 1), at::kFloat).to(at::kBFloat16));
  first.emplace_back("big", at::arange(3 << 20, at::kFloat));  // a gap of 12 MiB between runs
  for (int i = 0; i < 3; ++i) second.emplace_back("b." + std::to_string(i), at::full({7, 3}, i, at::kInt));
  save_tensors(dir / "one.safetensors", first);
  save_tensors(dir / "two.safetensors", second);
  auto map = DiskMap::open(std::vector<std::string>{dir / "one.safetensors", dir / "two.safetensors"});

  std::vector<const TensorInfo*> wanted = {&map.at("b.2"), &map.at("a.3"), &map.at("a.0"), &map.at("b.0"), &map.at("a.5")};
  for (bool direct : {false, true}) {
    for (unsigned threads : {1u, 3u}) {
      INFO("direct " << direct << ", threads " << threads);
      auto tensors = load_tensors(map, wanted, {std::nullopt, direct, threads});
      REQUIRE(tensors.size() == wanted.size());
      for (size_t i = 0; i < wanted.size(); ++i) CHECK(at::equal(tensors[i], load_tensor(map, *wanted[i])));
      auto converted = load_tensors(map, wanted, {at::kFloat, direct, threads});
      for (size_t i = 0; i < wanted.size(); ++i) {
        CHECK(converted[i].scalar_type() == at::kFloat);
        CHECK(at::equal(converted[i], load_tensor(map, *wanted[i]).to(at::kFloat)));
      }
    }
  }
}

TEST_CASE("load_tensors refuses a dtype LibTorch lacks before reading anything") {
  TempDir dir;
  auto path = dir.write("f4.safetensors", file_bytes(R"({"w":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}})", "ab"));
  auto map = DiskMap::open(path);
  std::vector<const TensorInfo*> wanted = {&map.at("w")};
  CHECK_THROWS_WITH(load_tensors(map, wanted), path + ": tensor 'w': dtype F4 has no LibTorch equivalent");
}

TEST_CASE("dtype names in LibTorch's spelling are exactly the types LibTorch has") {
  for (int i = 0; i <= static_cast<int>(DType::Q8_K); ++i) {
    const auto dtype = static_cast<DType>(i);
    const std::string torch_name(torch_dtype_name(dtype));
    INFO(torch_name);
    const bool has_torch_name = torch_name != dtype_name(dtype);
    CHECK(parse_torch_dtype(torch_name) == (has_torch_name ? std::optional(dtype) : std::nullopt));
    if (has_torch_name) CHECK(dtype_of(scalar_type(dtype)) == dtype);
    else CHECK_THROWS_AS(scalar_type(dtype), vramd::Error);
  }
  CHECK(torch_dtype_name(DType::BF16) == "bfloat16");
  CHECK(torch_dtype_name(DType::F8_E4M3) == "float8_e4m3fn");
  CHECK_FALSE(parse_torch_dtype("BF16"));  // safetensors' spelling is not LibTorch's
  CHECK_FALSE(parse_torch_dtype("auto"));
}

namespace {

// cast_into onto `device` from host values (pinned or not) gives what a plain cast gives, at the
// sizes where its steps begin and end, widening and narrowing, and allocates nothing there.
void check_casts(c10::Device device, bool pinned) {
  const std::pair<c10::ScalarType, c10::ScalarType> casts[] = {
      {at::kFloat8_e4m3fn, at::kBFloat16}, {at::kFloat8_e5m2, at::kFloat}, {at::kFloat, at::kBFloat16},
      {at::kBFloat16, at::kFloat8_e4m3fn}, {at::kBFloat16, at::kHalf}};
  at::manual_seed(7);
  for (const auto& [from, to] : casts) {
    for (const auto& shape : {std::vector<int64_t>{0}, {1}, {65536}, {65537}, {3 * 65536 + 7}, {1027, 1021}}) {
      INFO(c10::toString(from) << " to " << c10::toString(to) << ", " << at::IntArrayRef(shape) << (pinned ? ", pinned" : ""));
      at::Tensor value = (at::randn(shape) * 8).to(from);
      if (pinned) value = value.pin_memory();
      at::Tensor out = at::empty(shape, at::TensorOptions().dtype(to).device(device));
      const auto allocated = [&] {
        return device.is_cpu() ? 0 : c10::getDeviceAllocator(device.type())->getDeviceStats(device.index()).allocated_bytes[0].current;
      };
      const int64_t before = allocated();
      vramd::storage::cast_into(value, out);
      CHECK(allocated() == before);
      CHECK(at::equal(out.cpu(), value.to(to)));
    }
  }
}

}  // namespace

TEST_CASE("cast_into casts within the memory of the tensor it fills, as a plain cast does") {
  check_casts(c10::kCPU, false);
  at::Tensor out = at::empty({4, 3});
  CHECK_THROWS_WITH(vramd::storage::cast_into(at::zeros({3, 4}, at::kBFloat16).t(), out),
                    "cast_into needs contiguous tensors");
  CHECK_THROWS_WITH(vramd::storage::cast_into(at::zeros({5}, at::kBFloat16), out),
                    "cast_into cannot cast 5 elements into 12");
}

TEST_CASE("cast_into casts host values on a GPU, carrying them across as they are", "[cuda]") {
  if (!vramd::test::cuda_device_here()) return;
  for (const bool pinned : {false, true}) check_casts(c10::Device(c10::kCUDA, 0), pinned);
}
