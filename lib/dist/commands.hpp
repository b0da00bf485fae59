// What rank 0 of a group does to its partitioned models, told to the other ranks in order
// through the group's store (dist/group.hpp): command/S holds rank 0's S-th command as JSON
// ({"op", "model", "config"}), input/S a forward's inputs or an update's values. Every other
// rank reads them in order and the last to read one erases it. LibTorch-free: what a command does to a model is the
// caller's (server/runtime.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace vramd::dist {

class Group;

struct Command {
  int64_t seq = 0;
  std::string op;      // "load", "unload", "offload", "onload", "forward" or "update"
  std::string model;   // the partitioned model's name among the ranks (partition_name)
  std::string config;  // load: the config file's path
  std::string input;   // forward: the inputs as safetensors bytes; update: the new values, the same
};

// Rank 0: tells the other ranks, who do it in order.
void send_command(Group& group, const std::string& op, const std::string& model, const std::string& config = {},
                  std::string_view input = {});
// The number rank 0's next command will have: where a rank started again begins to follow.
int64_t next_command(Group& group);
// A name for one partitioned load of `model`, the same on every rank ("NAME/3").
std::string partition_name(Group& group, const std::string& model);

// The other ranks: rank 0's commands, in order.
class CommandReader {
 public:
  // From command 1, or for a rank started again after it died (dist::LocalRankSupervisor),
  // from the one VRAMD_REJOINED names: those before were for models loaded with the rank that
  // died, which fail and are loaded again.
  explicit CommandReader(std::shared_ptr<Group> group);

  int64_t first() const { return first_; }
  // The next command, waiting as long as it takes; nullopt once rank 0 is gone (`gone()` says
  // how it went).
  std::optional<Command> next();
  const std::string& gone() const { return gone_; }

 private:
  std::shared_ptr<Group> group_;
  int64_t first_ = 1, seq_ = 0;
  std::string gone_;
};

}  // namespace vramd::dist
