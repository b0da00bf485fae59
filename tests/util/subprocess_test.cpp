#include "util/subprocess.hpp"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>

#include "util/error.hpp"

using namespace vramd;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

TEST_CASE("A program is run with its input, and its output, errors and status are kept") {
  const auto result = run_process({"sh", "-c", "cat; echo said >&2; exit 3"}, "the input\n", 60s, 1 << 20);
  CHECK(result.out == "the input\n");
  CHECK(result.err == "said\n");
  CHECK(result.status == 3);
  CHECK_FALSE(result.timed_out);
  CHECK_FALSE(result.too_much);
  CHECK(run_process({"sh", "-c", "kill -9 $$"}, "", 60s, 1 << 20).status == 128 + 9);
}

TEST_CASE("A program gets none of the caller's descriptors beyond its three") {
  const int kept = ::dup(2);  // not close-on-exec
  REQUIRE(kept > 2);
  const auto result = run_process({"sh", "-c", "test -e /proc/self/fd/" + std::to_string(kept) + " && echo open || echo closed"},
                                  "", 60s, 1 << 20);
  ::close(kept);
  CHECK(result.out == "closed\n");
}

TEST_CASE("A program past its deadline or its output cap is killed, and one that cannot start is an error") {
  const auto slow = run_process({"sleep", "30"}, "", 200ms, 1 << 20);
  CHECK(slow.timed_out);
  CHECK(slow.status == 128 + 9);
  const auto chatty = run_process({"sh", "-c", "yes"}, "", 60s, 1 << 16);
  CHECK(chatty.too_much);
  CHECK(chatty.out.size() > (1 << 16));
  CHECK_THROWS_WITH(run_process({"/nowhere/python"}, "", 60s, 1 << 20),
                    Contains("cannot run /nowhere/python: No such file or directory"));
}
