#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "server/json_out.hpp"
#include "server/reply.hpp"

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
