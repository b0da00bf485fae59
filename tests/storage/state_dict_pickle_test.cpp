#include <catch2/catch.hpp>

#include <string>

#include "storage/state_dict_pickle.hpp"
#include "util/error.hpp"

using namespace vramd::storage;
using Catch::Matchers::Contains;

namespace {

// Pickle opcodes, protocol 2, as torch.save writes them.
const std::string kProto = "\x80\x02";
const std::string kStop = ".";
std::string put(int slot) { return std::string("q") + static_cast<char>(slot); }
std::string get(int slot) { return std::string("h") + static_cast<char>(slot); }
std::string u32(uint32_t value) {
  std::string out;
  for (int i = 0; i < 4; ++i) out += static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}
std::string text(const std::string& value) { return "X" + u32(static_cast<uint32_t>(value.size())) + value; }
std::string small(int value) { return std::string("K") + static_cast<char>(value); }
std::string global(const std::string& module, const std::string& name) { return "c" + module + "\n" + name + "\n"; }
std::string tuple(const std::string& items) { return "(" + items + "t"; }
std::string ordered_dict() { return global("collections", "OrderedDict") + ")R"; }
std::string storage(const std::string& type, const std::string& key, int size) {
  return tuple(text("storage") + global("torch", type) + text(key) + text("cpu") + small(size)) + "Q";
}
// torch._utils._rebuild_tensor_v2(storage, offset, shape, stride, False, OrderedDict())
std::string tensor(const std::string& storage, int offset, const std::string& shape, const std::string& stride) {
  return global("torch._utils", "_rebuild_tensor_v2") +
         tuple(storage + small(offset) + tuple(shape) + tuple(stride) + "\x89" + ordered_dict()) + "R";
}
std::string dict_of(const std::string& items) { return "}(" + items + "u"; }

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
  const std::string pickle = kProto + "}" + put(0) + text("self") + get(0) + "s" + kStop;
  CHECK_THAT(refusal(pickle), Contains("data.pkl: dicts nested deeper than 16 (the limit)"));
}

TEST_CASE("a pickle that names anything torch's weights_only list does not allow is refused before it runs") {
  const std::string call = kProto + global("posix", "system") + text("touch x") + "\x85" + "R" + kStop;
  CHECK(refusal(call) == "data.pkl at byte 2: GLOBAL 'posix.system' is not a global torch.load(weights_only=True) "
                         "allows that vramd reads; refused without loading it");
}

TEST_CASE("broken pickles are refused with what is wrong and where") {
  CHECK(refusal(kProto + "}") == "data.pkl at byte 3: truncated: 1 bytes wanted, 0 left");
  CHECK(refusal(kProto + get(7) + kStop) == "data.pkl at byte 2: memo slot 7 was never stored");
  CHECK(refusal(kProto + "\xff") == "data.pkl at byte 2: opcode 0xff is refused, as torch.load(weights_only=True) refuses it");
  CHECK(refusal(kProto + "s") == "data.pkl at byte 2: the stack is empty");
  CHECK(refusal(kProto + "(" + "s") == "data.pkl at byte 3: the stack is empty");  // nothing pops past a MARK
  CHECK(refusal(kProto + text("x") + kStop) == "data.pkl holds a str, not a state dict");
}

TEST_CASE("opcodes torch's weights_only unpickler refuses are refused by name") {
  CHECK(refusal("\x80\x04\x95" + std::string(8, '\0') + "}.") ==
        "data.pkl at byte 2: opcode FRAME (0x95) is refused, as torch.load(weights_only=True) refuses it");
  CHECK_THAT(refusal(kProto + "\x8c\x01w"), Contains("opcode SHORT_BINUNICODE (0x8c)"));
}

TEST_CASE("text that is not UTF-8 is refused") {
  CHECK_THAT(refusal(kProto + "}" + text("w\xff") + "N" + "s" + kStop), Contains("a string is not valid UTF-8: 'w\\xff'"));
}

TEST_CASE("BUILD may set an OrderedDict's plain attributes and nothing else") {
  const std::string metadata = dict_of(text("_metadata") + "}");
  CHECK(read_state_dict_pickle(kProto + ordered_dict() + metadata + "b" + kStop).skipped == 0);
  CHECK_THAT(refusal(kProto + ordered_dict() + dict_of(text("__setstate__") + "N") + "b" + kStop),
             Contains("BUILD sets the attribute '__setstate__' on an OrderedDict"));
  CHECK_THAT(refusal(kProto + "}" + metadata + "b" + kStop), Contains("BUILD on a dict; only an OrderedDict's"));
}

TEST_CASE("persistent ids other than the storage tuple are refused") {
  const std::string list_id = "](" + text("storage") + global("torch", "FloatStorage") + text("0") + text("cpu") + small(1) + "eQ";
  CHECK_THAT(refusal(kProto + list_id + kStop), Contains("persistent id list is not ('storage', type, key, location, size)"));
  CHECK_THAT(refusal(kProto + tuple(text("storage")) + "Q" + kStop), Contains("persistent id tuple of 1 items"));
}

TEST_CASE("every use of a storage key is checked against the one size and dtype it has") {
  const std::string small_storage = storage("FloatStorage", "0", 4);
  const std::string fits = tensor(small_storage, 0, small(2) + small(2), small(2) + small(1));
  auto state = read_state_dict_pickle(kProto + dict_of(text("w") + fits) + kStop);
  REQUIRE(state.tensors.size() == 1);
  CHECK(state.storages.at(0).bytes == 16);
  CHECK(state.tensors[0].end == 16);

  // A second tensor on the same key that claims more rows than the storage holds.
  const std::string past = tensor(storage("FloatStorage", "0", 4), 0, small(200) + small(2), small(2) + small(1));
  CHECK_THAT(refusal(kProto + dict_of(text("w") + fits + text("big") + past) + kStop),
             Contains("reaches element 399, past the storage's 4 F32 elements"));
  // The same key declared again as another type.
  const std::string twice = tensor(storage("DoubleStorage", "0", 4), 0, small(4), small(1));
  CHECK_THAT(refusal(kProto + dict_of(text("w") + fits + text("d") + twice) + kStop),
             Contains("storage '0' is declared as FloatStorage of 4, then as DoubleStorage of 4"));
}

TEST_CASE("zero-size tensors are empty byte ranges whatever their strides") {
  const std::string empty = tensor(storage("FloatStorage", "0", 0), 0, small(3) + small(0), small(1) + small(1));
  auto state = read_state_dict_pickle(kProto + dict_of(text("e") + empty) + kStop);
  REQUIRE(state.tensors.size() == 1);
  CHECK(state.tensors[0].unservable.empty());
  CHECK(state.tensors[0].begin == state.tensors[0].end);
}

TEST_CASE("strided tensors are kept with the reason they are not a byte range") {
  const std::string transposed = tensor(storage("FloatStorage", "0", 6), 0, small(3) + small(2), small(1) + small(3));
  auto state = read_state_dict_pickle(kProto + dict_of(text("t") + transposed) + kStop);
  REQUIRE(state.tensors.size() == 1);
  CHECK_THAT(state.tensors[0].unservable, Contains("tensor 't' is not contiguous in its storage"));
}

TEST_CASE("an OrderedDict built from a list of pairs keeps its items") {
  const std::string w = tensor(storage("FloatStorage", "0", 2), 0, small(2), small(1));
  const std::string pickle = kProto + global("collections", "OrderedDict") + tuple("](" + tuple(text("w") + w) + "e") + "R" + kStop;
  auto state = read_state_dict_pickle(pickle);
  REQUIRE(state.tensors.size() == 1);
  CHECK(state.tensors[0].name == "w");
}

TEST_CASE("int keys and plain values are counted and skipped") {
  const std::string pickle = kProto + dict_of(text("epoch") + small(3) + small(0) + dict_of(text("step") + small(1))) + kStop;
  auto state = read_state_dict_pickle(pickle);
  CHECK(state.tensors.empty());
  CHECK(state.skipped == 2);
}

TEST_CASE("the pickle machine's stack and memo are bounded and the limits named") {
  CHECK_THAT(refusal(kProto + std::string(kMaxPickleStack + 1, 'N')),
             Contains("the stack holds 1048576 items and marks (the limit)"));
  CHECK_THAT(refusal(kProto + std::string(kMaxPickleStack + 1, '(')), Contains("items and marks (the limit)"));
  CHECK_THAT(refusal(kProto + "N" + "r" + u32(0xffffffff)), Contains("memo slot 4294967295 is past the limit of 4194304"));
}

TEST_CASE("the number of objects a pickle builds is bounded and the limit named") {
  std::string pickle = kProto + "]";
  for (size_t i = 0; i < kMaxPickleObjects / 2 + 1; ++i) pickle += small(0) + "a";
  CHECK_THAT(refusal(pickle), Contains("more than 4194304 objects built (the limit)"));
}

TEST_CASE("a key set twice keeps its last value, as a Python dict does") {
  const std::string first = tensor(storage("FloatStorage", "0", 1), 0, small(1), small(1));
  const std::string last = tensor(storage("FloatStorage", "1", 2), 0, small(2), small(1));
  auto state = read_state_dict_pickle(kProto + dict_of(text("w") + first + text("w") + last) + kStop);
  REQUIRE(state.tensors.size() == 1);
  CHECK(state.tensors[0].shape == std::vector<int64_t>{2});
}
