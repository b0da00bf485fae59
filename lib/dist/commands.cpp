#include "dist/commands.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "dist/group.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::dist {
namespace {

constexpr const char* kCommands = "commands";  // the store's counter of rank 0's commands

std::string command_key(int64_t seq) { return "command/" + std::to_string(seq); }
std::string input_key(int64_t seq) { return "input/" + std::to_string(seq); }
std::string read_key(int64_t seq) { return "read/" + std::to_string(seq); }

}  // namespace

void send_command(Group& group, const std::string& op, const std::string& model, const std::string& config,
                  std::string_view input) {
  // Made before the command is counted: the other ranks wait for every command counted.
  if (!valid_utf8(config))
    throw Error(quote(config) + ": a partitioned model's config is named to the other ranks in JSON, so its path must be "
                "valid UTF-8; rename the file");
  const std::string text = nlohmann::json{{"op", op}, {"model", model}, {"config", config}}.dump();
  const int64_t seq = group.add(kCommands, 1);
  if (!input.empty()) group.set(input_key(seq), input);
  group.set(command_key(seq), text);
}

int64_t next_command(Group& group) { return group.add(kCommands, 0) + 1; }

std::string partition_name(Group& group, const std::string& model) {
  return model + "/" + std::to_string(group.add("loads", 1));
}

CommandReader::CommandReader(std::shared_ptr<Group> group) : group_(std::move(group)) {
  if (const char* rejoined = std::getenv("VRAMD_REJOINED")) first_ = std::max<int64_t>(1, std::atoll(rejoined));
  seq_ = first_;
}

std::optional<Command> CommandReader::next() {
  Command command;
  command.seq = seq_;
  try {
    nlohmann::json text;
    for (;;) {
      try {
        text = nlohmann::json::parse(group_->get(command_key(seq_), std::chrono::hours(1)));
        break;
      } catch (const Timeout&) {  // rank 0 is idle: wait on
      }
    }
    command.op = text.value("op", "");
    command.model = text.value("model", "");
    command.config = text.value("config", "");
    if (command.op == "forward" || command.op == "update") command.input = group_->get(input_key(seq_), std::chrono::minutes(1));
    if (group_->add(read_key(seq_), 1) == group_->size() - 1) {
      group_->erase(command_key(seq_));
      group_->erase(input_key(seq_));
      group_->erase(read_key(seq_));
    }
  } catch (const Error& e) {
    gone_ = e.what();
    return std::nullopt;
  }
  ++seq_;
  return command;
}

}  // namespace vramd::dist
