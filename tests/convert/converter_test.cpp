// ATen first: c10's logging defines a CHECK macro that Catch's must replace.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include "convert/chain.hpp"
#include "convert/converter.hpp"
#include "convert/evaluate.hpp"
#include "convert/lua_pattern.hpp"
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
    out["layers." .. layer .. ".k.weight"] = k:t():scale(0.5):shift(-1)
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
  const auto& k = find(plan, "layers.0.k.weight");
  CHECK(k.expr->describe() == "shift(scale(transpose(narrow(src['h.0.attn.c_attn.weight'], 1, 4, 4), 0, 1), 0.5), -1)");
  CHECK(at::equal(evaluate(*k.expr, map), f.fused.narrow(1, 4, 4).t() * 0.5 - 1));
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
  const std::string missing = f.error_of("return { x = src['h.0.ln.weigth']:t() }");
  CHECK_THAT(missing, Catch::StartsWith(path + ":1: the checkpoint has no tensor 'h.0.ln.weigth' (nearest: 'h.0.ln.weight', "));
  CHECK_THAT(missing, Catch::EndsWith("); src:get(name) gives nil for a name that may be missing"));
}

TEST_CASE("a converter that returns the wrong thing names the script and the target key") {
  Fixture f;
  auto path = f.dir / "convert.lua";
  CHECK(f.error_of("return 42") == path + ": returned number, not a table of target names to tensors");
  CHECK(f.error_of("return { w = 'oops' }") == path + ": target 'w' is a string, not a tensor");
  CHECK(f.error_of("return { src['h.0.ln.weight'] }") == path + ": returned a table with a number key; target names are strings");
  CHECK(f.error_of("return { ['w\\255\\n'] = src['h.0.ln.weight'] }") ==
        path + ": target 'w\\xff\\x0a' is not valid UTF-8, as safetensors and vramd's replies need");
  CHECK(f.error_of("while true do end") == path + ":1: ran past its time limit of 5000 ms");
}

TEST_CASE("a chained converter reads the first one's results and names a target the first does not give") {
  Fixture f;
  const std::string first = "local out = {}\nfor name, t in src:items() do out['first.' .. name] = t end\nreturn out";
  const auto plan = run_converter_code(chained("the first (a \"q\".lua)", first, "return { w = src['first.h.0.ln.weight'] }"),
                                       "chain.lua", f.map());
  REQUIRE(plan.tensors.size() == 1);
  CHECK(plan.tensors[0].target == "w");
  CHECK(plan.unused == std::vector<std::string>{"h.0.attn.c_attn.bias", "h.0.attn.c_attn.weight"});
  try {
    run_converter_code(chained("the first (a \"q\".lua)", first, "return { w = src['h.0.ln.weight'] }"), "chain.lua", f.map());
    FAIL("no error");
  } catch (const Error& e) {
    // Where the second reads it: its first line is the chained text's eighth.
    CHECK(std::string(e.what()) == "chain.lua:8: the first (a \"q\".lua) gives no tensor named 'h.0.ln.weight'");
  }
  // The first's errors keep its line numbers.
  try {
    run_converter_code(chained("the first", "local x = 1\nerror('bad line')", "return {}"), "chain.lua", f.map());
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "chain.lua:2: bad line");
  }
  CHECK(lua_literal("a\"\\\n\xc3\xa9" "1") == "\"a\\034\\092\\010\\195\\1691\"");
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

TEST_CASE("rename gives what string.find and string.gsub give for any pattern") {
  // rename() matches natively and hands what it does not handle to string.gsub: random
  // patterns, names and replacements, well-formed and not, against Lua's own functions.
  Fixture f;
  auto plan = run_converter(f.script(R"lua(
local find, gsub, format = string.find, string.gsub, string.format
local function reference(name, rules)
  for i = 1, #rules do
    if find(name, rules[i][1]) then return (gsub(name, rules[i][1], rules[i][2])) end
  end
  return nil
end
local seed = 12345
local function pick(list)
  seed = (seed * 1103515245 + 12345) % 2147483648
  return list[seed % #list + 1]
end
local tokens = { "a", "b", ".", "%.", "%d", "%a", "%w", "%s", "%A", "%D", "%z", "%%", "[ab]", "[^a]", "[a-c]",
                 "[%d_]", "[]]", "*", "+", "-", "?", "(", ")", "()", "%1", "%b()", "%f[%w]", "$", "[", "%", "%g" }
local letters = { "a", "b", "c", ".", "1", "23", "_", "(", ")", " ", "A", "\0" }
local replacements = { "", "x", "%0", "%1", "%2", "[%1]", "%%", "%a", "y%1z", "%" }
local cases, same = 0, 0
for _ = 1, 20000 do
  local pattern = (pick({ "", "^" }))
  for _ = 1, seed % 5 + 1 do pattern = pattern .. pick(tokens) end
  local name = ""
  for _ = 1, seed % 9 do name = name .. pick(letters) end
  local rules = { { pattern, pick(replacements) } }
  if seed % 3 == 0 then rules = { { "^zz", "q" }, rules[1] } end
  local ok1, got = pcall(rename, name, rules)
  local ok2, want = pcall(reference, name, rules)
  if not ok1 and not ok2 then  -- the same error, which rename() gives with the rule's number
    got, want = got:gsub("^.-rename rule %d+ %(pattern .-%): ", ""), want:gsub("^[^:]*:%d+: ", "")
  end
  if ok1 ~= ok2 or got ~= want then
    error(format("rename(%q, {{%q, %q}}): %s %s, string.gsub: %s %s", name, rules[#rules][1], rules[#rules][2],
                 tostring(ok1), tostring(got), tostring(ok2), tostring(want)))
  end
  cases = cases + 1
  if ok1 and got then same = same + 1 end
end
print(cases, same)
return {}
)lua"), f.map());
  REQUIRE(plan.printed.size() == 1);
  INFO(plan.printed[0]);
  // Enough of the cases matched for the comparison to mean something.
  CHECK(std::stoi(plan.printed[0].substr(plan.printed[0].find('\t') + 1)) > 2000);
}

TEST_CASE("lua_gsub leaves to Lua what it does not handle") {
  CHECK(lua_gsub("blocks.12.ff.w", "^blocks%.(%d+)%.", "layers.%1.")->text == "layers.12.ff.w");
  CHECK(lua_gsub("a.b.c", "%.", "/")->text == "a/b/c");
  CHECK(lua_gsub("abc", "", "-")->text == "-a-b-c-");
  CHECK(lua_gsub("abc", "x", "-")->count == 0);
  CHECK(lua_gsub("a(b)c", "%b()", "")== std::nullopt);
  CHECK(lua_gsub("abc", "()b", "%1") == std::nullopt);
  CHECK(lua_gsub("abab", "(a)%1", "") == std::nullopt);
  CHECK(lua_gsub("abc", "[a", "") == std::nullopt);
  CHECK(lua_gsub("abc", "(b", "%1") == std::nullopt);  // an unfinished capture in the replacement
  CHECK(lua_gsub("abc", "b", "%2") == std::nullopt);
  CHECK(lua_gsub("abc", "b", "x%") == std::nullopt);
  CHECK_THROWS_AS(lua_gsub(std::string(30, 'a'), ".-.-.-.-x", "", 1000), PatternTooComplex);
  CHECK(lua_gsub(std::string(30, 'a'), ".-.-.-.-x", "", 10'000'000)->count == 0);
}

TEST_CASE("a bad rename rule names the script line and the rule") {
  Fixture f;
  auto path = f.dir / "convert.lua";
  CHECK(f.error_of("local r = { { '^h', 'x' }, { '%', 'y' } }\nreturn { [rename('h.0', { { '^b', 'x' }, { '%', 'y' } })] = src['h.0.ln.weight'] }") ==
        path + ":2: rename rule 2 (pattern '%'): malformed pattern (ends with '%')");
  CHECK(f.error_of("return { [rename('h.0', { { '(h', 'x' } })] = src['h.0.ln.weight'] }") ==
        path + ":1: rename rule 1 (pattern '(h'): unfinished capture");
  CHECK(f.error_of("return { [rename('h.0', { 'h' })] = src['h.0.ln.weight'] }") ==
        path + ":1: rename rule 1 is a string, not a { pattern, replacement } table");
  CHECK(f.error_of("return { [rename('h.0', { { 'h' } })] = src['h.0.ln.weight'] }") ==
        path + ":1: rename rule 1 has no replacement; rules are { pattern, replacement }");
  CHECK(f.error_of("return { [rename(string.rep('a', 40), { { '.-.-.-.-.-.-.-.-x', 'y' } })] = src['h.0.ln.weight'] }") ==
        path + ":1: rename rule 1 (pattern '.-.-.-.-.-.-.-.-x'): pattern too complex: matching '" + std::string(40, 'a') +
        "' took more than 10000000 steps");
  CHECK(f.error_of("return { [rename('h.0')] = src['h.0.ln.weight'] }") ==
        path + ":1: bad argument #2 to 'rename' (table expected, got nil)");
  CHECK(f.error_of("return { [rename({}, { { 'h', 'x' } })] = src['h.0.ln.weight'] }") ==
        path + ":1: bad argument #1 to 'rename' (string expected, got table)");
}

TEST_CASE("src renamed renames every key as a rename loop does and refuses two keys becoming one") {
  Fixture f;
  const std::string rules = R"lua(local rules = { { "^h%.(%d+)%.ln%.", "layers.%1.norm." }, { "^h%.(%d+)%.attn%.c_attn%.", "qkv.%1." } }
)lua";
  auto bulk = run_converter(f.script(rules + "local out = src:renamed(rules)\nout['extra'] = out['qkv.0.bias']\nreturn out\n"), f.map());
  auto loop = run_converter(f.script(rules + R"lua(local out = {}
for name, t in src:items() do out[rename(name, rules) or name] = t end
out['extra'] = out['qkv.0.bias']
return out
)lua"), f.map());
  std::vector<std::string> targets, expected;
  for (const auto& conversion : bulk.tensors) targets.push_back(conversion.target + " " + conversion.expr->describe());
  for (const auto& conversion : loop.tensors) expected.push_back(conversion.target + " " + conversion.expr->describe());
  CHECK(targets == expected);
  CHECK(targets.front() == "extra src['h.0.attn.c_attn.bias']");

  auto path = f.dir / "convert.lua";
  CHECK(f.error_of("local out = src:renamed({ { '^h%.0%.attn%.c_attn%..*', 'qkv' } })\nreturn out") ==
        path + ":1: src:renamed: 'h.0.attn.c_attn.bias' and 'h.0.attn.c_attn.weight' both become 'qkv'");
  CHECK(f.error_of("\nlocal out = src:renamed({ { '^x', 'x' }, { '[', 'y' } })\nreturn out") ==
        path + ":2: rename rule 2 (pattern '['): malformed pattern (missing ']')");
  // `return src:renamed(...)` is a tail call, whose line Lua no longer knows: the script is named.
  CHECK(f.error_of("return src:renamed('h')") == path + ": src:renamed takes a table of { pattern, replacement } rules, not a string");
}

TEST_CASE("zeros makes a tensor read from nowhere and refuses a bad or huge shape") {
  Fixture f;
  const auto plan = run_converter(f.script("return { b = zeros({2, 3}, 'bfloat16'), w = src['h.0.ln.weight'] }"), f.map());
  const auto& zeros = find(plan, "b");
  CHECK(zeros.expr->describe() == "zeros([2, 3], bfloat16)");
  CHECK((zeros.expr->shape == std::vector<int64_t>{2, 3} && zeros.expr->dtype == storage::DType::BF16));
  CHECK(zeros.expr->sources().empty());
  CHECK(at::equal(evaluate(*zeros.expr, f.map()), at::zeros({2, 3}, at::kBFloat16)));
  auto path = f.dir / "convert.lua";
  CHECK(f.error_of("return { b = zeros({2, -1}, 'float32') }") == path + ":1: zeros([2, -1]): dimension -1 is negative");
  CHECK(f.error_of("return { b = zeros({65536, 65536, 2}, 'float32') }") ==
        path + ":1: zeros([65536, 65536, 2]): more than 2^32 elements");
  CHECK(f.error_of("return { b = zeros({2}, 'float7') }") ==
        path + ":1: unknown dtype 'float7' (expected float32, bfloat16, float16, float64, float8_e4m3fn, float8_e5m2, int64, int32, int16, int8, uint8 or bool)");
}

TEST_CASE("src shards gives each file's slice for cat to join and other reads of such a name say so") {
  TempDir dir;
  const at::Tensor whole = at::arange(6 * 4, at::kFloat).reshape({6, 4});
  const at::Tensor norm = at::ones({4}, at::kFloat);
  storage::save_tensors(dir / "consolidated.00.safetensors", {{"wq", whole.narrow(0, 0, 2)}, {"norm", norm}});
  storage::save_tensors(dir / "consolidated.01.safetensors", {{"wq", whole.narrow(0, 2, 4)}, {"norm", norm}});
  const auto map = storage::DiskMap::open(dir / "consolidated.*.safetensors", {.shards = true});
  const auto path = dir.write("convert.lua", R"lua(
local q = src:shards("wq")
assert(#q == 2 and #src:shards("norm") == 2 and #src == 2 and #src:keys() == 2)
assert(q[1].shape[1] == 2 and q[2].shape[1] == 4)
return { ["q.weight"] = cat(q, 0), ["norm.weight"] = src:shards("norm")[1] }
)lua");
  const auto plan = run_converter(path, map);
  const auto& q = find(plan, "q.weight");
  CHECK(q.expr->describe() == "cat([src:shards('wq')[1], src:shards('wq')[2]], 0)");
  CHECK(at::equal(evaluate(*q.expr, map), whole));
  CHECK(plan.unused == std::vector<std::string>{});

  const auto error_of = [&](const std::string& code) {
    try {
      run_converter(dir.write("bad.lua", code), map);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const std::string files = "2 files hold a slice of 'wq' (" + dir / "consolidated.00.safetensors" + ", " +
                            dir / "consolidated.01.safetensors" + "); src:shards(name) gives each, for cat to join";
  const auto bad = dir / "bad.lua";
  CHECK(error_of("return { w = src['wq'] }") == bad + ":1: src['wq']: " + files);
  CHECK(error_of("return { w = src:get('wq') }") == bad + ":1: src:get('wq'): " + files);
  CHECK(error_of("local out = {}\nfor name, t in src:items() do out[name] = t end\nreturn out") ==
        bad + ":2: src:items(): 2 files hold a slice of 'norm' (" + dir / "consolidated.00.safetensors" + ", " +
            dir / "consolidated.01.safetensors" + "); src:shards(name) gives each, for cat to join");
  CHECK(error_of("return { w = src:shards('wk')[1] }") ==
        bad + ":1: src:shards('wk'): the checkpoint has no tensor of that name");
  // A name is used when a slice of it is (a norm whole in every file is read from one).
  const auto partial = run_converter(dir.write("partial.lua", "return { w = src:shards('wq')[2] }"), map);
  CHECK(partial.unused == std::vector<std::string>{"norm"});
}

TEST_CASE("a narrow of a cat along its dimension reads only the parts it overlaps") {
  const auto a = source("a", storage::DType::F32, {4, 3}), b = source("b", storage::DType::F32, {2, 3}),
             c = source("c", storage::DType::F32, {5, 3});
  const auto joined = cat({a, b, c}, 0);
  CHECK(narrow(joined, 0, 5, 3)->describe() == "cat([narrow(src['b'], 0, 1, 1), narrow(src['c'], 0, 0, 2)], 0)");
  CHECK(narrow(joined, 0, 4, 2)->describe() == "src['b']");  // exactly one part: itself
  CHECK(narrow(joined, 0, 0, 11)->describe() == joined->describe());
  CHECK(narrow(joined, 1, 1, 2)->describe() == "narrow(" + joined->describe() + ", 1, 1, 2)");  // another dimension
  CHECK(narrow(joined, 0, 3, 0)->shape == std::vector<int64_t>{0, 3});

  // The values are the narrowed cat's.
  Fixture f;
  const auto map = f.map();
  const auto w = source("h.0.attn.c_attn.weight", storage::DType::F32, {4, 12});
  const auto both = cat({w, w}, 0);
  for (int64_t start = 0; start < 8; ++start)
    for (int64_t length = 0; start + length <= 8; ++length)
      CHECK(at::equal(evaluate(*narrow(both, 0, start, length), map), at::cat({f.fused, f.fused}, 0).narrow(0, start, length)));
}
