#include <catch2/catch.hpp>

#include <string>

#include "storage/state_dict_pickle.hpp"
#include "util/error.hpp"

using namespace vramd::storage;

namespace {

// Pickle opcodes, protocol 2.
const std::string kProto = "\x80\x02";
const std::string kEmptyDict = "}";
const std::string kSetItem = "s";
const std::string kStop = ".";
std::string put(int slot) { return std::string("q") + static_cast<char>(slot); }
std::string get(int slot) { return std::string("h") + static_cast<char>(slot); }
std::string text(const std::string& value) { return std::string("\x8c") + static_cast<char>(value.size()) + value; }

std::string refusal(const std::string& pickle) {
  try {
    read_state_dict_pickle(pickle);
  } catch (const vramd::Error& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("a pickled dict that holds itself is refused and leaks nothing") {
  // d = {}; d["self"] = d
  const std::string pickle = kProto + kEmptyDict + put(0) + text("self") + get(0) + kSetItem + kStop;
  CHECK(refusal(pickle) == "data.pkl: dicts nested too deeply");
}

TEST_CASE("a pickle that calls anything a state dict does not need is refused before it runs") {
  const std::string call = kProto + "cposix\nsystem\n" + text("touch x") + "\x85" + "R" + kStop;
  CHECK(refusal(call) == "data.pkl: calls posix.system, which a state dict does not need; refused");
}

TEST_CASE("broken pickles are refused with what is wrong") {
  CHECK(refusal(kProto + kEmptyDict) == "data.pkl: truncated pickle");
  CHECK(refusal(kProto + get(7) + kStop) == "data.pkl: pickle refers to memo 7, never stored");
  CHECK(refusal(kProto + "\xff") == "data.pkl: pickle opcode 0xff at byte 2 is not used by state dicts; refused");
  CHECK(refusal(kProto + kSetItem) == "data.pkl: pickle stack underflow");
  CHECK(refusal(kProto + text("x") + kStop) == "holds a string, not a state dict");
}

TEST_CASE("a dict of plain values is read with its non-tensors counted") {
  const std::string pickle = kProto + kEmptyDict + text("epoch") + "K\x03" + kSetItem + kStop;
  auto state = read_state_dict_pickle(pickle);
  CHECK(state.tensors.empty());
  CHECK(state.skipped == 1);
}
