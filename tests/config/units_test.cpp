#include <catch2/catch.hpp>

#include "config/units.hpp"
#include "util/error.hpp"

using namespace vramd::config;
using namespace std::chrono_literals;

TEST_CASE("sizes read in binary and decimal units") {
  CHECK(parse_size("512MiB") == 512ull << 20);
  CHECK(parse_size("2GiB") == 2ull << 30);
  CHECK(parse_size("1.5GB") == 1'500'000'000ull);
  CHECK(parse_size("64 KiB") == 65536);
  CHECK(parse_size("4096") == 4096);
  CHECK(parse_size("1T") == 1ull << 40);
  CHECK(parse_size(" 3B ") == 3);
}

TEST_CASE("a size that is not one says what was expected") {
  for (const char* text : {"", "GiB", "6GB?", "-1GiB", "1.2.3MB", "12 mib", "1e3"}) {
    INFO(text);
    CHECK_THROWS_WITH(parse_size(text), Catch::EndsWith(
        " is not a size; expected a number and a unit such as \"512MiB\", \"2GiB\" or \"1.5GB\""));
  }
  CHECK_THROWS_WITH(parse_size("99999999TiB"), "'99999999TiB' is too large a size");
}

TEST_CASE("durations read in ms s m h d and combinations and -1 is forever") {
  CHECK(parse_duration("30s") == 30s);
  CHECK(parse_duration("10m") == 10min);
  CHECK(parse_duration("1h30m") == 90min);
  CHECK(parse_duration("250ms") == 250ms);
  CHECK(parse_duration("1.5s") == 1500ms);
  CHECK(parse_duration("0") == 0ms);
  CHECK(parse_duration("-1") == std::nullopt);
  CHECK(format_duration(90min) == "90m");
  CHECK(format_duration(std::nullopt) == "forever");
}

TEST_CASE("a duration that is not one says what was expected") {
  for (const char* text : {"", "10", "10 minutes", "m", "-5s", "1h-"}) {
    INFO(text);
    CHECK_THROWS_WITH(parse_duration(text), Catch::Contains(" is not a duration; expected e.g. \"30s\""));
  }
}
