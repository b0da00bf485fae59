#include "storage/state_dict_pickle.hpp"

#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>
#include <unordered_map>
#include <variant>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::storage {
namespace {


struct Value;
// Values live in the unpickler's arena: a pickle can build cycles (a dict that holds itself),
// which reference counting would leak.
using ValuePtr = Value*;

struct None {};
struct MarkTag {};
struct Global {
  std::string module, name;
  std::string full() const { return module + "." + name; }
};
struct Storage {
  std::string key;
  DType dtype;
  uint64_t elements = 0;
};
struct Tensor {
  Storage storage;
  int64_t offset = 0;
  std::vector<int64_t> shape, stride;
};
struct Sequence {  // tuple or list
  std::vector<ValuePtr> items;
};
struct Dict {
  std::vector<std::pair<ValuePtr, ValuePtr>> items;
};

struct Value {
  std::variant<None, MarkTag, bool, int64_t, double, std::string, Sequence, Dict, Global, Storage, Tensor> v;
};


std::string describe(const Value& value) {
  static constexpr const char* kNames[] = {"None", "mark", "bool", "int", "float", "string",
                                           "sequence", "dict", "global", "storage", "tensor"};
  return kNames[value.v.index()];
}

template <typename T>
const T& as(const ValuePtr& value, const char* what) {
  if (const T* typed = std::get_if<T>(&value->v)) return *typed;
  throw Error(std::string("data.pkl: expected ") + what + ", found " + describe(*value));
}

std::vector<int64_t> int_list(const ValuePtr& value, const char* what) {
  std::vector<int64_t> out;
  for (const auto& item : as<Sequence>(value, what).items) out.push_back(as<int64_t>(item, what));
  return out;
}

std::optional<DType> storage_dtype(std::string_view name) {
  static const std::unordered_map<std::string_view, DType> kStorages = {
      {"FloatStorage", DType::F32},        {"DoubleStorage", DType::F64},
      {"HalfStorage", DType::F16},         {"BFloat16Storage", DType::BF16},
      {"LongStorage", DType::I64},         {"IntStorage", DType::I32},
      {"ShortStorage", DType::I16},        {"CharStorage", DType::I8},
      {"ByteStorage", DType::U8},          {"BoolStorage", DType::BOOL},
      {"ComplexFloatStorage", DType::C64}, {"UInt16Storage", DType::U16},
      {"UInt32Storage", DType::U32},       {"UInt64Storage", DType::U64},
      {"Float8_e4m3fnStorage", DType::F8_E4M3}, {"Float8_e5m2Storage", DType::F8_E5M2},
      {"Float8_e8m0fnuStorage", DType::F8_E8M0},
  };
  auto it = kStorages.find(name);
  if (it == kStorages.end()) return std::nullopt;
  return it->second;
}

// A pickle machine that knows only what state dicts are made of.
class Unpickler {
 public:
  explicit Unpickler(std::string_view data) : data_(data) {}

  template <typename T>
  ValuePtr make(T value) {
    if (arena_.size() >= kMaxValues) throw Error("data.pkl: more than " + std::to_string(kMaxValues) + " values");
    return &arena_.emplace_back(Value{std::move(value)});
  }

  ValuePtr run() {
    while (true) {
      const uint8_t op = byte();
      switch (op) {
        case 0x80: byte(); break;                      // PROTO
        case 0x95: bytes(8); break;                    // FRAME
        case '(': push(make(MarkTag{})); break;        // MARK
        case '.': return pop();                        // STOP
        case '0': pop(); break;                        // POP
        case '1': pop_to_mark(); break;                // POP_MARK
        case '2': push(top()); break;                  // DUP
        case 'N': push(make(None{})); break;
        case 0x88: push(make(true)); break;            // NEWTRUE
        case 0x89: push(make(false)); break;           // NEWFALSE
        case 'J': push(make(static_cast<int64_t>(static_cast<int32_t>(little(4))))); break;
        case 'K': push(make(static_cast<int64_t>(little(1)))); break;
        case 'M': push(make(static_cast<int64_t>(little(2)))); break;
        case 0x8a: push(make(long_int(byte()))); break;  // LONG1
        case 'G': push(make(binary_float())); break;     // BINFLOAT
        case 'X': push(make(std::string(bytes(little(4))))); break;  // BINUNICODE
        case 0x8c: push(make(std::string(bytes(byte())))); break;    // SHORT_BINUNICODE
        case 0x8d: push(make(std::string(bytes(little(8))))); break; // BINUNICODE8
        case 'T': case 'B': push(make(std::string(bytes(little(4))))); break;  // BINSTRING, BINBYTES
        case 'U': case 'C': push(make(std::string(bytes(byte())))); break;     // SHORT_BINSTRING/BYTES
        case ')': push(make(Sequence{})); break;       // EMPTY_TUPLE
        case 't': push(make(Sequence{pop_to_mark()})); break;  // TUPLE
        case 0x85: tuple_of(1); break;
        case 0x86: tuple_of(2); break;
        case 0x87: tuple_of(3); break;
        case ']': push(make(Sequence{})); break;       // EMPTY_LIST
        case 'l': push(make(Sequence{pop_to_mark()})); break;  // LIST
        case 'a': { auto item = pop(); list_items(top()).push_back(item); break; }  // APPEND
        case 'e': { auto items = pop_to_mark(); auto& list = list_items(top());
                    list.insert(list.end(), items.begin(), items.end()); break; }  // APPENDS
        case '}': push(make(Dict{})); break;           // EMPTY_DICT
        case 'd': { auto dict = make(Dict{}); set_items(dict, pop_to_mark()); push(dict); break; }
        case 's': { auto value = pop(); auto key = pop(); set_items(top(), {key, value}); break; }
        case 'u': { auto items = pop_to_mark(); set_items(top(), items); break; }  // SETITEMS
        case 'c': { auto module = line(); auto name = line(); push(make(Global{module, name})); break; }
        case 0x93: { auto name = pop(); auto module = pop();  // STACK_GLOBAL
                     push(make(Global{as<std::string>(module, "a module name"), as<std::string>(name, "a name")})); break; }
        case 'R': { auto args = pop(); auto callable = pop(); push(reduce(callable, args)); break; }
        case 'b': pop(); break;                        // BUILD: attributes such as _metadata
        case 'Q': push(persistent(pop())); break;      // BINPERSID
        case 'q': memo_[little(1)] = top(); break;     // BINPUT
        case 'r': memo_[little(4)] = top(); break;     // LONG_BINPUT
        case 0x94: memo_[memo_.size()] = top(); break; // MEMOIZE
        case 'h': push(memo(little(1))); break;        // BINGET
        case 'j': push(memo(little(4))); break;        // LONG_BINGET
        default:
          throw Error("data.pkl: pickle opcode 0x" + hex(op) + " at byte " + std::to_string(position_ - 1) +
                      " is not used by state dicts; refused");
      }
    }
  }

 private:
  static std::string hex(uint8_t value) {
    char text[3];
    std::snprintf(text, sizeof text, "%02x", value);
    return text;
  }

  uint8_t byte() { return static_cast<uint8_t>(bytes(1)[0]); }

  std::string_view bytes(uint64_t count) {
    if (count > data_.size() - position_) throw Error("data.pkl: truncated pickle");
    auto out = data_.substr(position_, count);
    position_ += count;
    return out;
  }

  uint64_t little(int count) {
    auto raw = bytes(count);
    uint64_t value = 0;
    for (int i = count - 1; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(raw[i]);
    return value;
  }

  int64_t long_int(uint8_t count) {
    if (count == 0) return 0;
    if (count > 8) throw Error("data.pkl: integer wider than 64 bits");
    uint64_t value = little(count);
    if (count < 8 && (value >> (8 * count - 1)) & 1) value |= ~uint64_t{0} << (8 * count);  // sign
    return static_cast<int64_t>(value);
  }

  double binary_float() {
    auto raw = bytes(8);
    uint64_t bits = 0;
    for (char c : raw) bits = (bits << 8) | static_cast<uint8_t>(c);  // big-endian
    double value;
    std::memcpy(&value, &bits, 8);
    return value;
  }

  std::string line() {
    auto end = data_.find('\n', position_);
    if (end == std::string_view::npos) throw Error("data.pkl: truncated pickle");
    std::string out(data_.substr(position_, end - position_));
    position_ = end + 1;
    return out;
  }

  void push(ValuePtr value) {
    if (stack_.size() > kMaxStack) throw Error("data.pkl: pickle stack too deep");
    stack_.push_back(std::move(value));
  }
  ValuePtr pop() {
    if (stack_.empty()) throw Error("data.pkl: pickle stack underflow");
    auto value = std::move(stack_.back());
    stack_.pop_back();
    return value;
  }
  const ValuePtr& top() {
    if (stack_.empty()) throw Error("data.pkl: pickle stack underflow");
    return stack_.back();
  }
  std::vector<ValuePtr> pop_to_mark() {
    for (size_t i = stack_.size(); i-- > 0;) {
      if (std::holds_alternative<MarkTag>(stack_[i]->v)) {
        std::vector<ValuePtr> items(stack_.begin() + static_cast<std::ptrdiff_t>(i) + 1, stack_.end());
        stack_.resize(i);
        return items;
      }
    }
    throw Error("data.pkl: pickle has no mark to pop to");
  }
  void tuple_of(size_t count) {
    if (stack_.size() < count) throw Error("data.pkl: pickle stack underflow");
    Sequence tuple{std::vector<ValuePtr>(stack_.end() - static_cast<std::ptrdiff_t>(count), stack_.end())};
    stack_.resize(stack_.size() - count);
    push(make(std::move(tuple)));
  }
  ValuePtr memo(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) throw Error("data.pkl: pickle refers to memo " + std::to_string(index) + ", never stored");
    return it->second;
  }
  std::vector<ValuePtr>& list_items(const ValuePtr& list) {
    if (auto* sequence = std::get_if<Sequence>(&list->v)) return sequence->items;
    throw Error("data.pkl: append to a " + describe(*list));
  }
  void set_items(const ValuePtr& target, const std::vector<ValuePtr>& items) {
    auto* dict = std::get_if<Dict>(&target->v);
    if (!dict) throw Error("data.pkl: set items of a " + describe(*target));
    if (items.size() % 2) throw Error("data.pkl: odd number of dict items");
    for (size_t i = 0; i < items.size(); i += 2) dict->items.emplace_back(items[i], items[i + 1]);
  }

  ValuePtr persistent(const ValuePtr& id) {
    const auto& fields = as<Sequence>(id, "a persistent id tuple").items;
    if (fields.size() != 5 || as<std::string>(fields[0], "'storage'") != "storage")
      throw Error("data.pkl: unknown persistent id (not a storage)");
    const auto& type = as<Global>(fields[1], "a storage type");
    auto dtype = type.module == "torch" ? storage_dtype(type.name) : std::nullopt;
    if (!dtype) throw Error("data.pkl: storage type " + type.full() + " is not supported");
    int64_t elements = as<int64_t>(fields[4], "a storage size");
    if (elements < 0) throw Error("data.pkl: negative storage size");
    return make(Storage{as<std::string>(fields[2], "a storage key"), *dtype, static_cast<uint64_t>(elements)});
  }

  ValuePtr reduce(const ValuePtr& callable, const ValuePtr& args_value) {
    const auto& function = as<Global>(callable, "a callable");
    const auto& args = as<Sequence>(args_value, "an argument tuple").items;
    const std::string name = function.full();
    if (name == "collections.OrderedDict") return make(Dict{});
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      if (args.size() < 4) throw Error("data.pkl: " + name + " with too few arguments");
      return make(Tensor{as<Storage>(args[0], "a storage"), as<int64_t>(args[1], "a storage offset"),
                         int_list(args[2], "a shape"), int_list(args[3], "strides")});
    }
    if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
      if (args.empty()) throw Error("data.pkl: " + name + " without a tensor");
      as<Tensor>(args[0], "a tensor");
      return args[0];
    }
    if (name == "torch._tensor._rebuild_from_type_v2") {
      if (args.size() < 3) throw Error("data.pkl: " + name + " with too few arguments");
      const auto& type = as<Global>(args[1], "a tensor type").full();
      if (type != "torch.Tensor" && type != "torch.nn.parameter.Parameter")
        throw Error("data.pkl: tensor subclass " + type + " is not supported");
      return reduce(args[0], args[2]);
    }
    throw Error("data.pkl: calls " + name + ", which a state dict does not need; refused");
  }

  static constexpr size_t kMaxStack = 1 << 20;
  static constexpr size_t kMaxValues = 1 << 24;
  std::deque<Value> arena_;
  std::string_view data_;
  size_t position_ = 0;
  std::vector<ValuePtr> stack_;
  std::unordered_map<uint64_t, ValuePtr> memo_;
};

// The tensor's bytes within its storage; only contiguous tensors are a byte range.
PickledTensor byte_range(const std::string& name, const Tensor& tensor) {
  const uint64_t item = dtype_bits(tensor.storage.dtype) / 8;
  if (tensor.shape.size() != tensor.stride.size())
    throw Error("tensor " + quote(name) + " has " + std::to_string(tensor.shape.size()) + " sizes but " +
                std::to_string(tensor.stride.size()) + " strides");
  uint64_t elements = 1;
  int64_t expected_stride = 1;
  for (size_t i = tensor.shape.size(); i-- > 0;) {
    if (tensor.shape[i] < 0) throw Error("tensor " + quote(name) + " has a negative size");
    if (tensor.shape[i] != 1 && tensor.stride[i] != expected_stride)
      throw Error("tensor " + quote(name) + " is not contiguous in its storage (shape " + format_shape(tensor.shape) +
                  ", strides " + format_shape(tensor.stride) + "); save it with .contiguous() or as safetensors");
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(tensor.shape[i]), &elements) ||
        __builtin_mul_overflow(expected_stride, tensor.shape[i], &expected_stride))
      throw Error("tensor " + quote(name) + " has a size that overflows");
  }
  uint64_t storage_bytes = 0;
  if (tensor.offset < 0 || elements > tensor.storage.elements ||
      static_cast<uint64_t>(tensor.offset) > tensor.storage.elements - elements ||
      __builtin_mul_overflow(tensor.storage.elements, item, &storage_bytes))
    throw Error("tensor " + quote(name) + " reaches past the end of its storage " + quote(tensor.storage.key));
  PickledTensor out;
  out.name = name;
  out.dtype = tensor.storage.dtype;
  out.shape = tensor.shape;
  out.storage = tensor.storage.key;
  out.storage_bytes = storage_bytes;
  out.begin = static_cast<uint64_t>(tensor.offset) * item;
  out.end = out.begin + elements * item;
  return out;
}

void flatten(const std::string& prefix, const Dict& dict, int depth, PickledStateDict& out) {
  if (depth > 8) throw Error("data.pkl: dicts nested too deeply");
  for (const auto& [key_value, value] : dict.items) {
    const auto* key = std::get_if<std::string>(&key_value->v);
    if (!key) throw Error("data.pkl: a state-dict key is a " + describe(*key_value) + ", not a string");
    const std::string name = prefix + *key;
    if (const auto* nested = std::get_if<Dict>(&value->v))
      flatten(name + ".", *nested, depth + 1, out);
    else if (const auto* tensor = std::get_if<Tensor>(&value->v))
      out.tensors.push_back(byte_range(name, *tensor));
    else
      ++out.skipped;
  }
}

}  // namespace

PickledStateDict read_state_dict_pickle(std::string_view data) {
  Unpickler unpickler(data);  // owns every value until the state dict is flattened
  auto root = unpickler.run();
  const auto* dict = std::get_if<Dict>(&root->v);
  if (!dict) throw Error("holds a " + describe(*root) + ", not a state dict");
  PickledStateDict state;
  flatten("", *dict, 0, state);
  return state;
}

}  // namespace vramd::storage
