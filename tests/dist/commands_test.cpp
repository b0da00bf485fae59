// The rank-follower protocol (dist/commands.hpp) over a real group store: rank 0 and rank 1
// joined in this process, on a free port.
#include "dist/commands.hpp"

#include <catch2/catch.hpp>
#include <cstdlib>

#include "dist/group.hpp"
#include "support/free_port.hpp"

namespace {

std::shared_ptr<vramd::dist::Group> join(int rank, uint16_t port) {
  vramd::dist::GroupOptions options;
  options.rank = rank;
  options.world_size = 2;
  options.master_port = port;
  options.timeout = std::chrono::seconds(10);
  return vramd::dist::Group::join(options);
}

}  // namespace

TEST_CASE("dist commands reach the other ranks in order and are erased once read") {
  using namespace vramd::dist;
  const uint16_t port = vramd::test::free_port();
  auto leader = join(0, port);
  auto follower = join(1, port);

  CHECK(next_command(*leader) == 1);
  const std::string name = partition_name(*leader, "llama");
  CHECK(name == "llama/1");
  CHECK(partition_name(*leader, "llama") == "llama/2");
  send_command(*leader, "load", name, "/configs/llama.toml");
  send_command(*leader, "forward", name, {}, std::string("\0inputs", 7));
  send_command(*leader, "unload", name);
  CHECK(next_command(*leader) == 4);

  ::unsetenv("VRAMD_REJOINED");
  CommandReader reader(follower);
  CHECK(reader.first() == 1);
  auto load = reader.next();
  REQUIRE(load);
  CHECK((load->seq == 1 && load->op == "load" && load->model == name && load->config == "/configs/llama.toml"));
  CHECK(load->input.empty());
  auto forward = reader.next();
  REQUIRE(forward);
  CHECK((forward->seq == 2 && forward->op == "forward"));
  CHECK(forward->input == std::string("\0inputs", 7));
  auto unload = reader.next();
  REQUIRE(unload);
  CHECK((unload->seq == 3 && unload->op == "unload" && unload->model == name));

  // The only other rank read them: they are gone from the store.
  CHECK_THROWS_AS(leader->get("command/2", std::chrono::milliseconds(50)), Timeout);
  CHECK_THROWS_AS(leader->get("input/2", std::chrono::milliseconds(50)), Timeout);

  SECTION("a rank started again follows from the command VRAMD_REJOINED names") {
    send_command(*leader, "offload", name);
    send_command(*leader, "onload", name);
    ::setenv("VRAMD_REJOINED", "5", 1);
    CommandReader rejoined(follower);
    ::unsetenv("VRAMD_REJOINED");
    CHECK(rejoined.first() == 5);
    auto onload = rejoined.next();
    REQUIRE(onload);
    CHECK((onload->seq == 5 && onload->op == "onload"));
  }
  SECTION("once rank 0 is gone, the reader says so instead of waiting") {
    leader.reset();
    CHECK_FALSE(reader.next());
    CHECK_THAT(reader.gone(), Catch::Contains("store"));
  }
}
