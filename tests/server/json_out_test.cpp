#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "server/json_out.hpp"
#include "server/reply.hpp"
#include "server/status.hpp"

using namespace vramd::server;

namespace {

// The same values through both sinks, keys in the order nlohmann's objects keep them (sorted):
// the text must be json_line's of the tree, byte for byte.
template <class Out>
void write(Out& out, const std::string& text) {
  out.object();
  out.key("a").array().end();
  out.key("b").object().end();
  out.field("c", true).field("d", false).key("e").value(nullptr);
  out.field("f", uint64_t{18446744073709551615u}).field("g", int64_t{-9223372036854775807 - 1}).field("h", size_t{0});
  out.field("i", 1.0).field("j", 0.1).field("k", 1e300).field("l", -2.5e-7);
  out.field("m", std::numeric_limits<double>::quiet_NaN()).field("n", std::numeric_limits<double>::infinity());
  out.field("o", text).field("oa", std::optional<uint64_t>{}).field("ob", std::optional<uint64_t>{7});
  out.key("p").array().value("x").object().field("q", 1).end().array().array().end().end().value(2).end();
  out.key("r").value(nlohmann::json{{"s", {1, 2}}, {"t", "u\nv"}});
  out.field("z" + text, "the key escaped too");  // after "r" whatever the text
  out.end();
}

}  // namespace

TEST_CASE("JsonOut writes what json_line writes of the same values") {
  for (const std::string& text : {std::string("plain"), std::string(""), std::string("quote \" and \\ back"),
                                 std::string("tab\tnew\nline\x01\x1f del\x7f"), std::string("caf\xc3\xa9 \xe2\x82\xac"),
                                 std::string("bad \xff\xfe utf-8 \xc3"), std::string("nul \0 inside", 13)}) {
    INFO(text);
    std::string written;
    JsonOut out(written);
    write(out, text);
    JsonTree tree;
    write(tree, text);
    std::string line = json_line(tree.take());
    line.pop_back();
    CHECK(written == line);
  }
}

TEST_CASE("JsonOut and JsonTree write a lone value and nested empties") {
  std::string written;
  JsonOut(written).value("only");
  CHECK(written == "\"only\"");
  written.clear();
  JsonOut(written).array().array().end().object().end().end();
  CHECK(written == "[[],{}]");
  JsonTree tree;
  tree.array().array().end().object().end().end();
  CHECK(tree.take() == nlohmann::json::parse("[[],{}]"));
}

TEST_CASE("JsonOut holds 32 levels open in place and refuses a 33rd") {
  std::string written;
  JsonOut out(written);
  for (int i = 0; i < 32; ++i) out.array();
  CHECK_THROWS_WITH(out.array(), "JsonOut: more than 32 levels open");
  for (int i = 0; i < 32; ++i) out.end();
  CHECK(written == std::string(32, '[') + std::string(32, ']'));
  CHECK(nlohmann::json::parse(written).is_array());
}

TEST_CASE("JsonOut writes a double as text that reads back as the same float") {
  for (const double d : {0.0, -0.0, 1.0, 1e15, 1e16, 123456.789, 0.025618684, 5e-324, 1.7976931348623157e308,
                         -3.0, 2.5e-7, 4503599627370497.0}) {
    INFO(d);
    std::string written;
    JsonOut(written).value(d);
    const auto back = nlohmann::json::parse(written);
    CHECK(back.is_number_float());
    CHECK(std::signbit(back.get<double>()) == std::signbit(d));
    CHECK(back.get<double>() == d);
  }
}

TEST_CASE("a lease's manifest line holds every field of its regions, tensors, plan and adapters") {
  vramd::weights::Manifest manifest;
  manifest.device = "cpu";
  manifest.bytes = 96;
  manifest.version = 3;
  manifest.regions.push_back({.kind = "memfd", .path = "", .size = 64, .fd = {}});
  manifest.regions.push_back({.kind = "file", .path = "/m/a \"b\".safetensors", .size = 4096, .fd = {}});
  manifest.tensors.push_back({.name = "w", .dtype = "float32", .shape = {2, 4}, .strides = {4, 1}, .region = 1,
                              .offset = 8, .packed = "", .unpacked_shape = {}});
  manifest.tensors.push_back({.name = "e", .dtype = "float32", .shape = {0}, .strides = {1}, .region = std::nullopt,
                              .offset = 0, .packed = "", .unpacked_shape = {}});
  manifest.tensors.push_back({.name = "q", .dtype = "uint8", .shape = {34}, .strides = {1}, .region = 0, .offset = 0,
                              .packed = "Q8_0", .unpacked_shape = {32}});
  manifest.plan = vramd::weights::ManagedPlan{
      .device = "cpu", .dtype = "float32", .limit = std::nullopt, .units = {{.name = "l", .tensors = {"w", "q"}, .resting = 66, .computed = 160}}};
  manifest.loras = std::vector<vramd::config::LoraConfig>{{.path = "/a.safetensors", .scale = 0.75}};
  const std::string line = manifest_line(manifest, "m", 7);
  REQUIRE(line.back() == '\n');
  CHECK(nlohmann::json::parse(line) == nlohmann::json::parse(R"({
    "model": "m", "lease": 7, "device": "cpu", "bytes": 96, "version": 3,
    "regions": [{"kind": "memfd", "size": 64}, {"kind": "file", "size": 4096, "path": "/m/a \"b\".safetensors"}],
    "tensors": [
      {"name": "w", "dtype": "float32", "shape": [2, 4], "strides": [4, 1], "region": 1, "offset": 8},
      {"name": "e", "dtype": "float32", "shape": [0], "strides": [1], "region": null, "offset": 0},
      {"name": "q", "dtype": "uint8", "shape": [34], "strides": [1], "region": 0, "offset": 0,
       "packed": {"type": "Q8_0", "shape": [32]}}],
    "plan": {"device": "cpu", "dtype": "float32", "limit": null,
             "units": [{"name": "l", "tensors": ["w", "q"], "resting": 66, "computed": 160}]},
    "loras": [{"path": "/a.safetensors", "scale": 0.75}]})"));
  CHECK(nlohmann::json::parse(manifest_line({}, "m", std::nullopt))["lease"].is_null());
}
