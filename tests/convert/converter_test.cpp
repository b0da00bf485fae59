// ATen first: c10's logging defines a CHECK macro that Catch's must replace.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include "convert/converter.hpp"
#include "convert/evaluate.hpp"
#include "storage/tensor_io.hpp"
#include "support/temp_dir.hpp"
#include "util/error.hpp"

using namespace vramd;
using namespace vramd::convert;
using vramd::test::TempDir;

namespace {

struct Fixture {
  TempDir dir;
  at::Tensor fused = at::arange(4 * 12, at::kFloat).reshape({4, 12});
  at::Tensor bias = at::arange(12, at::kFloat);
  at::Tensor norm = at::ones({4}, at::kBFloat16);

  Fixture() {
    storage::save_tensors(dir / "model.safetensors",
                          {{"h.0.attn.c_attn.weight", fused}, {"h.0.attn.c_attn.bias", bias}, {"h.0.ln.weight", norm}});
  }
  storage::DiskMap map() const { return storage::DiskMap::open(dir / "model.safetensors"); }
  std::string script(const std::string& code) const { return dir.write("convert.lua", code); }
  std::string error_of(const std::string& code) const {
    try {
      run_converter(script(code), map());
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  }
};

const Conversion& find(const ConversionPlan& plan, const std::string& target) {
  for (const auto& conversion : plan.tensors)
    if (conversion.target == target) return conversion;
  throw std::runtime_error("no target " + target);
}

}  // namespace

TEST_CASE("a converter splits transposes renames and casts lazily and evaluation matches LibTorch") {
  Fixture f;
  auto path = f.script(R"lua(
local out = {}
for name, t in src:items() do
  local layer = name:match("^h%.(%d+)%.attn%.c_attn%.weight$")
  if layer then
    local q, k, v = t:chunk(3, 1)
    out["layers." .. layer .. ".q.weight"] = q:t()
    out["layers." .. layer .. ".k.weight"] = k:t():scale(0.5)
    out["layers." .. layer .. ".v.weight"] = v:t():cast("bfloat16")
  end
end
out["qkv.bias"] = cat({src["h.0.attn.c_attn.bias"]:narrow(0, 0, 4), src:get("h.0.attn.c_attn.bias"):narrow(0, 8, 4)}, 0)
out["stacked"] = stack({src["h.0.ln.weight"], src["h.0.ln.weight"]}, 0):reshape({-1})
print("targets", #src)
return out
)lua");
  auto map = f.map();
  auto plan = run_converter(path, map);
  REQUIRE(plan.tensors.size() == 5);
  CHECK(plan.tensors[0].target == "layers.0.k.weight");  // sorted
  CHECK(plan.printed == std::vector<std::string>{"targets\t3"});
  CHECK(plan.unused.empty());

  const auto& q = find(plan, "layers.0.q.weight");
  CHECK(q.expr->shape == std::vector<int64_t>{4, 4});
  CHECK(q.expr->describe() == "transpose(narrow(src['h.0.attn.c_attn.weight'], 1, 0, 4), 0, 1)");
  CHECK(at::equal(evaluate(*q.expr, map), f.fused.narrow(1, 0, 4).t()));
  CHECK(at::equal(evaluate(*find(plan, "layers.0.k.weight").expr, map), f.fused.narrow(1, 4, 4).t() * 0.5));
  const auto& v = find(plan, "layers.0.v.weight");
  CHECK(v.expr->dtype == storage::DType::BF16);
  CHECK(at::equal(evaluate(*v.expr, map), f.fused.narrow(1, 8, 4).t().to(at::kBFloat16)));
  CHECK(at::equal(evaluate(*find(plan, "qkv.bias").expr, map), at::cat({f.bias.narrow(0, 0, 4), f.bias.narrow(0, 8, 4)})));
  auto stacked = evaluate(*find(plan, "stacked").expr, map);
  CHECK(stacked.sizes() == at::IntArrayRef({8}));
  CHECK(stacked.is_contiguous());
}

TEST_CASE("source keys no target reads are listed as unused") {
  Fixture f;
  auto plan = run_converter(f.script("return { w = src['h.0.ln.weight'] }"), f.map());
  CHECK(plan.unused == std::vector<std::string>{"h.0.attn.c_attn.bias", "h.0.attn.c_attn.weight"});
}

TEST_CASE("shape mistakes name the script line and source key before any data is read") {
  Fixture f;
  auto path = f.dir / "convert.lua";
  CHECK(f.error_of("local t = src['h.0.attn.c_attn.weight']\nreturn { x = t:chunk(5, 1) }") ==
        path + ":2: chunk of src['h.0.attn.c_attn.weight'] (shape [4, 12]): dimension 1 (size 12) does not split into 5 equal parts");
  CHECK(f.error_of("return { x = src['h.0.ln.weight']:transpose(0, 1) }") ==
        path + ":1: transpose of src['h.0.ln.weight'] (shape [4]): dimension 1 is out of range for 1 dimensions (counted from 0)");
  CHECK(f.error_of("return { x = src['h.0.attn.c_attn.weight']:reshape({5, -1}) }") ==
        path + ":1: reshape of src['h.0.attn.c_attn.weight'] (shape [4, 12]): cannot fit 48 elements into [5, -1]");
  CHECK(f.error_of("return { x = cat({src['h.0.attn.c_attn.bias'], src['h.0.ln.weight']}, 0) }") ==
        path + ":1: cat of src['h.0.ln.weight'] (shape [4]): its dtype bfloat16 differs from the first tensor's float32; cast first");
  CHECK(f.error_of("return { x = src['h.0.ln.weight']:narrow(0, 2, 3) }") ==
        path + ":1: narrow of src['h.0.ln.weight'] (shape [4]): elements [2, 5) of dimension 0 are outside its size 4");
  CHECK(f.error_of("return { x = src['h.0.ln.weight']:cast('float7') }") ==
        path + ":1: unknown dtype 'float7' (expected float32, bfloat16, float16, float64, float8_e4m3fn, float8_e5m2, int64, int32, int16, int8, uint8 or bool)");
  CHECK(f.error_of("return { x = src['h.0.ln.weight']:flip() }") == path + ":1: tensors have no field or method 'flip'");
  CHECK(f.error_of("return { x = src['missing']:t() }") ==
        path + ":1: attempt to index field 'missing' (a nil value)");
}

TEST_CASE("a converter that returns the wrong thing names the script and the target key") {
  Fixture f;
  auto path = f.dir / "convert.lua";
  CHECK(f.error_of("return 42") == path + ": returned number, not a table of target names to tensors");
  CHECK(f.error_of("return { w = 'oops' }") == path + ": target 'w' is a string, not a tensor");
  CHECK(f.error_of("return { src['h.0.ln.weight'] }") == path + ": returned a table with a number key; target names are strings");
  CHECK(f.error_of("while true do end") == path + ":1: ran past its time limit of 5000 ms");
}

TEST_CASE("rename applies the first matching rule") {
  Fixture f;
  auto plan = run_converter(f.script(R"lua(
local rules = { { "^h%.(%d+)%.ln%.", "layers.%1.norm." }, { "^h%.", "blocks." } }
local out = {}
for name, t in src:items() do out[rename(name, rules)] = t end
return out
)lua"), f.map());
  std::vector<std::string> targets;
  for (const auto& conversion : plan.tensors) targets.push_back(conversion.target);
  CHECK(targets == std::vector<std::string>{"blocks.0.attn.c_attn.bias", "blocks.0.attn.c_attn.weight", "layers.0.norm.weight"});
}
