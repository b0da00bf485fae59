#include "util/utf8.hpp"

#include <catch2/catch.hpp>
#include <string>

#include "util/format.hpp"

using namespace vramd;

TEST_CASE("Well-formed UTF-8 is valid and passes through unchanged") {
  for (std::string text : {"", "plain", "caf\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\xf4\x8f\xbf\xbf"}) {
    CHECK(valid_utf8(text));
    CHECK(escape_invalid_utf8(text) == text);
  }
}

TEST_CASE("Ill-formed UTF-8 is invalid and escaped byte by byte") {
  CHECK_FALSE(valid_utf8("\xff\xfe"));
  CHECK(escape_invalid_utf8("\xff\xfe") == "\\xff\\xfe");
  CHECK_FALSE(valid_utf8("\xc0\xae"));  // overlong '.'
  CHECK(escape_invalid_utf8("a\xc0\xae") == "a\\xc0\\xae");
  CHECK_FALSE(valid_utf8("\xed\xa0\x80"));      // a surrogate
  CHECK_FALSE(valid_utf8("\xf4\x90\x80\x80"));  // past U+10FFFF
  CHECK_FALSE(valid_utf8("\xe2\x82"));          // cut short
  CHECK(escape_invalid_utf8("\xe2\x82") == "\\xe2\\x82");
  CHECK_FALSE(valid_utf8("\x80"));
  CHECK(valid_utf8(escape_invalid_utf8("\xe2\x82\xac\xe2\x82\xff")));
}

TEST_CASE("Escaping keeps different texts different") {
  CHECK(escape_invalid_utf8("\\xff") != escape_invalid_utf8("\xff"));
  CHECK(escape_invalid_utf8("a\nb") == "a\\x0ab");
  CHECK(quote("h.\xff") == "'h.\\xff'");
}

TEST_CASE("Printable text keeps tabs and backslashes and escapes what a terminal would act on") {
  CHECK(printable("a\tb\\x0a") == "a\tb\\x0a");  // escaped before: not escaped again
  CHECK(printable("\x1b[2J\r\n\x7f\xff caf\xc3\xa9") == "\\x1b[2J\\x0d\\x0a\\x7f\\xff caf\xc3\xa9");
}
