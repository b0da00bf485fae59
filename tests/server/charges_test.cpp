#include <catch2/catch.hpp>

#include "server/charges.hpp"

using namespace vramd;
using namespace vramd::server;

TEST_CASE("a charge is what the weights can hold plus what is held back for the job and the leases") {
  struct Case {
    const char* what;
    Holdings can_hold;
    DeviceBytes held, job, leases;
    Holdings charged;
  };
  const Case cases[] = {
      {"nothing loaded, nothing reserved", {}, {}, {}, {}, {}},
      {"a load under way: its room alone", {}, {}, {{"cpu", 70}}, {}, {{"cpu", {{"job", 70}}}}},
      {"held below the plan counts the plan",
       {{"cuda:0", {{"limit", 30}}}, {"cpu", {{"onload", 80}}}},
       {{"cuda:0", 10}, {"cpu", 80}},
       {},
       {},
       {{"cuda:0", {{"limit", 30}}}, {"cpu", {{"onload", 80}}}}},
      {"held past the plan is counted, never hidden",
       {{"cpu", {{"limit", 30}}}},
       {{"cpu", 45}},
       {},
       {},
       {{"cpu", {{"limit", 30}, {"unplanned", 15}}}}},
      {"held on a device the plan does not name",
       {{"cuda:0", {{"weights", 100}}}},
       {{"cuda:0", 100}, {"cpu", 5}},
       {},
       {},
       {{"cuda:0", {{"weights", 100}}}, {"cpu", {{"unplanned", 5}}}}},
      {"a job's room and a client's use beside the weights",
       {{"cpu", {{"weights", 100}}}},
       {{"cpu", 100}},
       {{"cpu", 7}},
       {{"cuda:0", 64}, {"cpu", 3}},
       {{"cpu", {{"weights", 100}, {"job", 7}, {"leases", 3}}}, {"cuda:0", {{"leases", 64}}}}},
      {"parts of no bytes are left out", {{"cpu", {{"weights", 0}}}}, {{"cpu", 0}}, {{"cpu", 0}}, {}, {}},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    CHECK(charge(c.can_hold, c.held, c.job, c.leases) == c.charged);
  }
}
