#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>
#include <numeric>

#include "storage/disk_map.hpp"
#include "storage/safetensors_writer.hpp"
#include "support/temp_dir.hpp"
#include "util/error.hpp"

using namespace vramd::storage;
using vramd::test::TempDir;

namespace {

// Float tensors whose bytes encode their name, so any mix-up shows.
struct Tensors {
  std::vector<std::vector<float>> values;
  std::vector<TensorData> data;

  void add(const std::string& name, int64_t count) {
    values.emplace_back(static_cast<size_t>(count));
    std::iota(values.back().begin(), values.back().end(), static_cast<float>(std::hash<std::string>{}(name) % 1000));
    data.push_back({name, DType::F32, {count},
                    {reinterpret_cast<const std::byte*>(values.back().data()), static_cast<size_t>(count) * 4}});
  }
  const std::vector<float>& of(const std::string& name) const {
    for (size_t i = 0; i < data.size(); ++i)
      if (data[i].name == name) return values[i];
    throw std::runtime_error("no " + name);
  }
};

std::vector<float> read_floats(const DiskMap& map, const std::string& name) {
  const auto& info = map.at(name);
  std::vector<float> out(info.nbytes / 4);
  map.read(info, {reinterpret_cast<std::byte*>(out.data()), info.nbytes});
  return out;
}

std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const vramd::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Bytes this process has passed through read(2)/pread(2), as the kernel counts them.
uint64_t bytes_read_by_process() {
  std::ifstream io("/proc/self/io");
  std::string key;
  uint64_t value = 0;
  while (io >> key >> value)
    if (key == "rchar:") return value;
  throw std::runtime_error("no rchar in /proc/self/io");
}

}  // namespace

TEST_CASE("a single file is indexed by name and reads return each tensor's own bytes") {
  TempDir dir;
  Tensors t;
  t.add("layers.0.weight", 16);
  t.add("layers.1.weight", 8);
  write_safetensors(dir / "model.safetensors", t.data, {{"format", "pt"}});
  auto map = DiskMap::open(dir / "model.safetensors");
  REQUIRE(map.tensors().size() == 2);
  CHECK(map.tensors()[0].name() == "layers.0.weight");
  CHECK(map.files()[0].metadata.at(0).second == "pt");
  CHECK(map.total_bytes() == 24 * 4);
  CHECK(read_floats(map, "layers.1.weight") == t.of("layers.1.weight"));
  CHECK(map.find("nope") == nullptr);
  CHECK_THAT(error_of([&] { map.at("nope"); }), Catch::EndsWith("model.safetensors: has no tensor 'nope'"));

  const auto& info = map.at("layers.0.weight");
  std::vector<float> direct(16);
  map.read_direct(info, {reinterpret_cast<std::byte*>(direct.data()), info.nbytes});
  CHECK(direct == t.of("layers.0.weight"));
  auto [bytes, owner] = map.bytes(info);
  CHECK(std::memcmp(bytes.data(), t.of("layers.0.weight").data(), info.nbytes) == 0);
}

TEST_CASE("a sharded checkpoint opens from its folder or its index file") {
  TempDir dir;
  Tensors a, b;
  a.add("x", 4);
  a.add("y", 4);
  b.add("z", 4);
  write_safetensors(dir / "model-00001-of-00002.safetensors", a.data);
  write_safetensors(dir / "model-00002-of-00002.safetensors", b.data);
  dir.write("model.safetensors.index.json",
            R"({"metadata": {"total_size": 48}, "weight_map": {"x": "model-00001-of-00002.safetensors",
                "y": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors"}})");
  for (const auto& source : {dir.path().string(), dir / "model.safetensors.index.json"}) {
    auto map = DiskMap::open(source);
    REQUIRE(map.tensors().size() == 3);
    CHECK(map.files().size() == 2);
    CHECK(read_floats(map, "z") == b.of("z"));
    CHECK(map.files()[map.at("z").file].path == dir / "model-00002-of-00002.safetensors");
  }
}

TEST_CASE("an index that names keys or shards that are not there is refused with the names") {
  TempDir dir;
  Tensors a;
  a.add("x", 4);
  write_safetensors(dir / "one.safetensors", a.data);
  SECTION("a missing key") {
    auto index = dir.write("m.safetensors.index.json",
                           R"({"weight_map": {"x": "one.safetensors", "ghost": "one.safetensors"}})");
    CHECK(error_of([&] { DiskMap::open(index); }) ==
          index + ": 1 key(s) named in weight_map are not in " + dir / "one.safetensors" + ": 'ghost'");
  }
  SECTION("a missing shard") {
    auto index = dir.write("m.safetensors.index.json", R"({"weight_map": {"x": "two.safetensors"}})");
    CHECK(error_of([&] { DiskMap::open(index); }) ==
          index + ": names the shard 'two.safetensors' (for 1 keys), which does not exist");
  }
  SECTION("a shard outside the folder") {
    auto index = dir.write("m.safetensors.index.json", R"({"weight_map": {"x": "../one.safetensors"}})");
    CHECK(error_of([&] { DiskMap::open(index); }) ==
          index + ": weight_map entry 'x' names '../one.safetensors', which is not a file beside the index");
  }
  SECTION("not JSON") {
    auto index = dir.write("m.safetensors.index.json", "{\"weight_map\": ");
    CHECK_THAT(error_of([&] { DiskMap::open(index); }), Catch::StartsWith(index + ": not valid JSON: "));
  }
  SECTION("shard tensors the index does not name are left out, with a warning") {
    Tensors both;
    both.add("x", 4);
    both.add("extra", 2);
    write_safetensors(dir / "one.safetensors", both.data);
    auto map = DiskMap::open(dir.write("m.safetensors.index.json", R"({"weight_map": {"x": "one.safetensors"}})"));
    CHECK(map.tensors().size() == 1);
    REQUIRE(map.warnings().size() == 1);
    CHECK_THAT(map.warnings()[0], Catch::Contains("1 tensor(s) not named in"));
  }
}

TEST_CASE("a glob or a list are merged and a key in two files is refused") {
  TempDir dir;
  Tensors a, b;
  a.add("x", 4);
  b.add("y", 4);
  write_safetensors(dir / "a.safetensors", a.data);
  write_safetensors(dir / "b.safetensors", b.data);
  CHECK(DiskMap::open(dir / "*.safetensors").tensors().size() == 2);
  CHECK(DiskMap::open(std::vector<std::string>{dir / "a.safetensors", dir / "b.safetensors"}).tensors().size() == 2);
  CHECK(error_of([&] { DiskMap::open(dir / "*.nothing"); }) == dir / "*.nothing" + ": no file matches this pattern");
  CHECK(error_of([&] { DiskMap::open(dir / "absent.safetensors"); }) ==
        dir / "absent.safetensors" + ": no such file or folder");

  write_safetensors(dir / "c.safetensors", a.data);
  CHECK(error_of([&] { DiskMap::open(dir / "*.safetensors"); }) ==
        dir / "c.safetensors" + ": holds the key 'x', which " + dir / "a.safetensors" + " holds too; when each " +
            "file holds a slice of every tensor (tensor-parallel shards, as Meta's consolidated.NN.pth), a " +
            "converter joins them: src:shards(name) gives each file's slice (scripts/converters/meta_llama.lua " +
            "does this)");
}

TEST_CASE("with shards allowed, a name several files hold is listed once per file, in file order") {
  TempDir dir;
  Tensors first, second;
  first.add("w", 4);
  first.add("norm", 2);
  second.add("w", 6);
  second.add("norm", 2);
  write_safetensors(dir / "consolidated.00.safetensors", first.data);
  write_safetensors(dir / "consolidated.01.safetensors", second.data);
  const auto map = DiskMap::open(dir / "consolidated.*.safetensors", {.shards = true});
  REQUIRE(map.tensors().size() == 4);
  const auto w = map.shards("w");
  REQUIRE(w.size() == 2);
  CHECK(map.files()[w[0].file].path == dir / "consolidated.00.safetensors");
  CHECK(map.files()[w[1].file].path == dir / "consolidated.01.safetensors");
  CHECK((w[0].shard == 0 && w[1].shard == 1 && w[1].shape == std::vector<int64_t>{6}));
  CHECK(map.find("w") == &w[0]);
  CHECK(&map.at("w", 1) == &w[1]);
  CHECK(map.shards("absent").empty());
  std::vector<float> slice(6);
  map.read(map.at("w", 1), {reinterpret_cast<std::byte*>(slice.data()), 24});
  CHECK(slice == second.of("w"));
  CHECK(error_of([&] { map.at("w", 2); }) ==
        dir / "consolidated.*.safetensors" + ": holds 'w' in 2 files, not 3");
}

TEST_CASE("a folder is read as Hugging Face reads one") {
  TempDir dir;
  Tensors weights, stray;
  weights.add("w", 4);
  stray.add("input_ids", 2);
  write_safetensors(dir / "inputs.safetensors", stray.data);
  // The only checkpoint file is the checkpoint.
  CHECK(DiskMap::open(dir.path().string()).tensors()[0].name() == "input_ids");
  // Two, and neither named as Hugging Face saves one: an error saying how to name them.
  write_safetensors(dir / "weights.safetensors", weights.data);
  CHECK(error_of([&] { DiskMap::open(dir.path().string()); }) ==
        dir.path().string() + ": holds 2 checkpoint files (inputs.safetensors, weights.safetensors) and neither an " +
            "index naming its shards nor a file named as Hugging Face saves one (model.safetensors); name the file to " +
            "load, or load them together with checkpoint = \"" + dir / "*.safetensors" + "\"");
  // model.safetensors is the checkpoint; what lies beside it is left out, with a warning.
  write_safetensors(dir / "model.safetensors", weights.data);
  const auto map = DiskMap::open(dir.path().string());
  REQUIRE(map.files().size() == 1);
  CHECK(map.files()[0].path == dir / "model.safetensors");
  REQUIRE(map.warnings().size() == 1);
  CHECK(map.warnings()[0] == dir.path().string() + ": loading model.safetensors as Hugging Face would; " +
                                 "inputs.safetensors, weights.safetensors beside it left out (checkpoint = \"" +
                                 dir / "*.safetensors" + "\" loads them all)");
}

TEST_CASE("a bad shard is reported with its path") {
  TempDir dir;
  auto bad = dir.write("bad.safetensors", std::string("\x03\0\0\0\0\0\0\0{}", 10));
  CHECK(error_of([&] { DiskMap::open(bad); }) == bad + ": header length 3 runs past the end of the file (10 bytes)");
  TempDir empty;
  CHECK_THAT(error_of([&] { DiskMap::open(empty.path().string()); }), Catch::Contains("holds no checkpoint"));
}

TEST_CASE("a prefix takes one model out of a file that holds several") {
  TempDir dir;
  Tensors t;
  t.add("text_encoder.w", 4);
  t.add("unet.w", 8);
  t.add("unet.b", 2);
  auto path = dir / "pipeline.safetensors";
  write_safetensors(path, t.data);

  auto unet = DiskMap::open(path, {"unet.", true});
  REQUIRE(unet.tensors().size() == 2);
  CHECK(unet.tensors()[0].name() == "b");
  CHECK(unet.at("w").key == "unet.w");
  CHECK(read_floats(unet, "w") == t.of("unet.w"));
  CHECK(unet.total_bytes() == 40);

  auto kept = DiskMap::open(path, {"unet.", false});
  CHECK(kept.find("unet.w") != nullptr);

  CHECK(error_of([&] { DiskMap::open(path, {"vae.", true}); }) ==
        path + ": no key starts with the prefix 'vae.' (3 keys, such as 'text_encoder.w', 'unet.b', 'unet.w')");
}

TEST_CASE("loading one model from a multi-model file reads only that model's bytes") {
  TempDir dir;
  Tensors t;
  for (int i = 0; i < 4; ++i) t.add("small." + std::to_string(i), 64 << 10);  // 1 MiB in all
  for (int i = 0; i < 4; ++i) t.add("large." + std::to_string(i), 1 << 20);   // 16 MiB in all
  auto path = dir / "two-models.safetensors";
  write_safetensors(path, t.data);

  const uint64_t before = bytes_read_by_process();
  auto small = DiskMap::open(path, {"small.", true});
  for (const auto& info : small.tensors()) {
    std::vector<std::byte> buffer(info.nbytes);
    small.read(info, buffer);
  }
  const uint64_t read = bytes_read_by_process() - before;

  uint64_t header_length = 0;
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(&header_length), 8);
  const uint64_t wanted = small.total_bytes();
  CHECK(wanted == 1u << 20);
  CHECK(read >= wanted);
  // The header's length, the header and the tensors asked for; the slack is this test's own
  // read of /proc/self/io. The other model's 16 MiB are never read.
  CHECK(read <= 8 + header_length + wanted + 1024);
}
