#include <catch2/catch.hpp>

#include <cstring>
#include <string>

#include "storage/safetensors_header.hpp"
#include "storage/safetensors_writer.hpp"
#include "util/error.hpp"

using namespace vramd::storage;

namespace {

std::string file_bytes(const std::string& json, const std::string& data, uint64_t declared) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((declared >> (8 * i)) & 0xff);
  return out + json + data;
}

std::string file_bytes(const std::string& json, const std::string& data = "") {
  return file_bytes(json, data, json.size());
}

SafetensorsHeader parse(const std::string& file) {
  return parse_safetensors_file({reinterpret_cast<const std::byte*>(file.data()), file.size()});
}

std::string rejection(const std::string& file) {
  try {
    parse(file);
  } catch (const vramd::Error& e) {
    return e.what();
  }
  return "(accepted)";
}

std::string tensor(const std::string& name, const std::string& dtype, const std::string& shape,
                   const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

}  // namespace

TEST_CASE("a well-formed header is parsed with its tensors and its metadata") {
  auto file = file_bytes("{\"__metadata__\":{\"format\":\"pt\"}," + tensor("b", "F32", "[2]", "[4,12]") +
                             "," + tensor("a", "U8", "[4]", "[0,4]") + "}   ",
                         std::string(12, 'x'));
  auto header = parse(file);
  REQUIRE(header.tensors.size() == 2);
  CHECK(header.tensors[0].name == "a");
  CHECK(header.tensors[1].name == "b");
  CHECK(header.tensors[1].dtype == DType::F32);
  CHECK(header.tensors[1].shape == std::vector<int64_t>{2});
  CHECK(header.tensors[1].begin == 4);
  CHECK(header.data_offset == 8 + file.size() - 8 - 12);
  REQUIRE(header.metadata.size() == 1);
  CHECK(header.metadata[0] == std::pair<std::string, std::string>{"format", "pt"});
}

TEST_CASE("every safetensors dtype is accepted with its own element size") {
  struct Case { const char* name; const char* shape; uint64_t bytes; };
  const Case cases[] = {
      {"BOOL", "[3]", 3},  {"U8", "[3]", 3},       {"I8", "[3]", 3},       {"U16", "[3]", 6},
      {"I16", "[3]", 6},   {"U32", "[3]", 12},     {"I32", "[3]", 12},     {"U64", "[3]", 24},
      {"I64", "[3]", 24},  {"F16", "[3]", 6},      {"BF16", "[3]", 6},     {"F32", "[3]", 12},
      {"F64", "[3]", 24},  {"C64", "[3]", 24},     {"F8_E4M3", "[3]", 3},  {"F8_E5M2", "[3]", 3},
      {"F8_E8M0", "[3]", 3}, {"F6_E2M3", "[4]", 3}, {"F6_E3M2", "[4]", 3}, {"F4", "[2, 3]", 3},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    auto file = file_bytes("{" + tensor("t", c.name, c.shape, "[0," + std::to_string(c.bytes) + "]") + "}",
                           std::string(c.bytes, '\0'));
    auto header = parse(file);
    CHECK(dtype_name(header.tensors.at(0).dtype) == c.name);
  }
}

TEST_CASE("empty files and empty tensors and trailing spaces are accepted") {
  CHECK(parse(file_bytes("{}")).tensors.empty());
  CHECK(parse(file_bytes("{}        ")).tensors.empty());
  auto header = parse(file_bytes("{" + tensor("e", "F32", "[0, 5]", "[0,0]") + "," +
                                 tensor("s", "F32", "[]", "[0,4]") + "}", "abcd"));
  CHECK(header.tensors.size() == 2);
}

TEST_CASE("each kind of malformed file is rejected with its own message") {
  const std::string ok_tensor = tensor("w", "F32", "[1]", "[0,4]");
  SECTION("too short for a length") {
    CHECK(rejection("abc") == "file is 3 bytes, too small to hold a safetensors header length");
  }
  SECTION("header length above the limit") {
    CHECK(rejection(file_bytes("{}", "", 100'000'001)) ==
          "header length 100000001 exceeds the limit of 100000000 bytes");
  }
  SECTION("header length past the end") {
    CHECK(rejection(file_bytes("{}", "", 50)) == "header length 50 runs past the end of the file (10 bytes)");
  }
  SECTION("not starting with a brace") {
    CHECK(rejection(file_bytes(" {}")) == "header does not start with '{'; this is not a safetensors file");
  }
  SECTION("invalid UTF-8") {
    CHECK(rejection(file_bytes("{\"w\xff\":1}")) == "header is not valid UTF-8");
  }
  SECTION("invalid JSON") {
    CHECK_THAT(rejection(file_bytes("{\"w\": {")), Catch::StartsWith("header is not valid JSON: "));
  }
  SECTION("a tensor that is not an object") {
    CHECK(rejection(file_bytes("{\"w\":[1,2]}")) ==
          "tensor 'w' is an array, not an object with dtype, shape and data_offsets");
  }
  SECTION("missing fields") {
    CHECK(rejection(file_bytes("{\"w\":{\"shape\":[],\"data_offsets\":[0,0]}}")) == "tensor 'w' has no dtype");
    CHECK(rejection(file_bytes("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,0]}}")) == "tensor 'w' has no shape");
    CHECK(rejection(file_bytes("{\"w\":{\"dtype\":\"F32\",\"shape\":[]}}")) == "tensor 'w' has no data_offsets");
  }
  SECTION("an unknown field") {
    CHECK(rejection(file_bytes("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", "abcd")) ==
          "tensor 'w' has unknown field 'x' (expected dtype, shape, data_offsets)");
  }
  SECTION("an unknown dtype, and dtypes are case-sensitive") {
    CHECK(rejection(file_bytes("{" + tensor("w", "F31", "[1]", "[0,4]") + "}", "abcd")) ==
          "tensor 'w' has unknown dtype 'F31'");
    CHECK(rejection(file_bytes("{" + tensor("w", "f32", "[1]", "[0,4]") + "}", "abcd")) ==
          "tensor 'w' has unknown dtype 'f32'");
  }
  SECTION("shapes must be non-negative integers") {
    CHECK(rejection(file_bytes("{" + tensor("w", "F32", "[-1]", "[0,4]") + "}", "abcd")) ==
          "tensor 'w' has a shape entry that is a number below zero, not a non-negative integer");
    CHECK(rejection(file_bytes("{" + tensor("w", "F32", "[1.5]", "[0,4]") + "}", "abcd")) ==
          "tensor 'w' has a shape entry that is a number, not a non-negative integer");
    CHECK(rejection(file_bytes("{" + tensor("w", "F32", "\"1\"", "[0,4]") + "}", "abcd")) ==
          "tensor 'w' has a shape that is a string, not an array");
  }
  SECTION("data_offsets must be two integers") {
    CHECK(rejection(file_bytes("{" + tensor("w", "F32", "[1]", "[0,4,8]") + "}", "abcd")) ==
          "tensor 'w' has data_offsets that are not an array of two integers");
  }
  SECTION("end before start") {
    CHECK(rejection(file_bytes("{" + tensor("h.0.w", "F32", "[2]", "[16,8]") + "}", std::string(16, 'x'))) ==
          "tensor 'h.0.w' has data_offsets [16, 8]: end before start");
  }
  SECTION("offsets past the data region") {
    CHECK(rejection(file_bytes("{" + tensor("w", "F32", "[2]", "[0,8]") + "}", "abcd")) ==
          "tensor 'w' has data_offsets [0, 8] past the end of the data region (4 bytes); is the file truncated?");
  }
  SECTION("a size that does not match the shape") {
    CHECK(rejection(file_bytes("{" + tensor("w", "F32", "[2, 3]", "[0,20]") + "}", std::string(20, 'x'))) ==
          "tensor 'w' has shape [2, 3] of F32 (24 bytes) but data_offsets [0, 20] span 20 bytes");
  }
  SECTION("a shape whose element count overflows") {
    CHECK(rejection(file_bytes("{" + tensor("w", "F32", "[4294967296, 4294967296]", "[0,0]") + "}")) ==
          "tensor 'w' has shape [4294967296, 4294967296] whose element count overflows");
    CHECK(rejection(file_bytes("{" + tensor("w", "F64", "[4611686018427387904]", "[0,0]") + "}")) ==
          "tensor 'w' has shape [4611686018427387904] whose byte size overflows");
  }
  SECTION("packed types that do not fill whole bytes") {
    CHECK(rejection(file_bytes("{" + tensor("w", "F4", "[3]", "[0,2]") + "}", "ab")) ==
          "tensor 'w' has shape [3] of F4, which is not a whole number of bytes");
  }
  SECTION("overlapping tensors") {
    CHECK(rejection(file_bytes("{" + tensor("a", "F32", "[2]", "[0,8]") + "," + tensor("b", "F32", "[1]", "[4,8]") + "}",
                               std::string(8, 'x'))) ==
          "tensor 'b' has data_offsets [4, 8] overlapping tensor 'a' at [0, 8]");
  }
  SECTION("a hole between tensors") {
    CHECK(rejection(file_bytes("{" + tensor("a", "F32", "[1]", "[0,4]") + "," + tensor("b", "F32", "[1]", "[8,12]") + "}",
                               std::string(12, 'x'))) ==
          "tensor 'b' has data_offsets [8, 12], leaving a hole of 4 bytes at offset 4");
  }
  SECTION("trailing bytes after the last tensor") {
    CHECK(rejection(file_bytes("{" + ok_tensor + "}", "abcdefg")) ==
          "the data region has 3 trailing bytes after the last tensor (7 bytes, tensors cover 4)");
  }
  SECTION("a tensor named twice") {
    CHECK(rejection(file_bytes("{" + ok_tensor + "," + ok_tensor + "}", "abcd")) == "header has the tensor 'w' twice");
  }
  SECTION("metadata that is not strings, or repeats") {
    CHECK(rejection(file_bytes("{\"__metadata__\":{\"n\":1}}")) ==
          "__metadata__ value for key 'n' is a number; metadata values must be strings");
    CHECK(rejection(file_bytes("{\"__metadata__\":[]}")) == "__metadata__ is an array, not an object of strings");
    CHECK(rejection(file_bytes("{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}")) == "__metadata__ has the key 'k' twice");
    CHECK(rejection(file_bytes("{\"__metadata__\":{},\"__metadata__\":{}}")) == "header has the key '__metadata__' twice");
  }
  SECTION("control characters in names are escaped in messages") {
    CHECK(rejection(file_bytes("{\"a\\nb\":[]}")) ==
          "tensor 'a\\x0ab' is an array, not an object with dtype, shape and data_offsets");
  }
}

TEST_CASE("the writer's output parses back aligned and padded") {
  const float weights[3] = {1, 2, 3};
  const uint8_t flags[1] = {1};
  std::vector<TensorData> tensors = {
      {"flag", DType::U8, {1}, {reinterpret_cast<const std::byte*>(flags), 1}},
      {"w", DType::F32, {3}, {reinterpret_cast<const std::byte*>(weights), 12}},
  };
  auto file = serialize_safetensors(tensors, {{"format", "pt"}});
  auto header = parse(file);
  CHECK(header.data_offset % 8 == 0);
  REQUIRE(header.tensors.size() == 2);
  CHECK(header.tensors[1].name == "w");
  CHECK(header.tensors[1].begin == 0);  // larger elements first keeps every tensor aligned
  CHECK(std::memcmp(file.data() + header.data_offset, weights, 12) == 0);
  CHECK(header.metadata.at(0).second == "pt");
}

TEST_CASE("the writer refuses bytes that do not match the shape and repeated names") {
  const float weights[3] = {1, 2, 3};
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(weights), 12);
  std::vector<TensorData> wrong = {{"w", DType::F32, {4}, bytes}};
  CHECK_THROWS_WITH(serialize_safetensors(wrong), "tensor 'w' of shape [4] and dtype F32 is given 12 bytes");
  std::vector<TensorData> twice = {{"w", DType::F32, {3}, bytes}, {"w", DType::F32, {3}, bytes}};
  CHECK_THROWS_WITH(serialize_safetensors(twice), "tensor 'w' is given twice");
}
