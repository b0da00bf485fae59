// One concern, one class, and so past the usual 600 lines: the machine's opcodes (a switch on
// each byte and the handlers it calls) and the globals each dialect allows, which only make sense
// read together, as CPython's own unpickler keeps them.
#include "storage/pickle_machine.hpp"

#include <cstdio>
#include <deque>
#include <map>
#include <span>
#include <unordered_map>
#include <unordered_set>

#include "storage/state_dict_pickle.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::storage::pickle {

std::string describe(const Value& value) {
  switch (value.kind) {
    case Kind::None: return "None";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::Str: return "str";
    case Kind::Tuple: return "tuple";
    case Kind::List: return "list";
    case Kind::Dict: return value.ordered ? "OrderedDict" : "dict";
    case Kind::Global: return std::string(value.text) + "." + std::string(value.name);
    case Kind::Storage: return "storage";
    case Kind::Tensor: return "tensor";
    case Kind::Object: return std::string(value.name);
    case Kind::Other: return std::string(value.text);
  }
  return "value";
}

namespace {

struct AllowedGlobal {
  std::string_view module, name;
  Callable callable;
};

constexpr AllowedGlobal kGlobals[] = {
    {"collections", "OrderedDict", Callable::OrderedDict},
    {"collections", "Counter", Callable::Counter},
    {"torch.nn.parameter", "Parameter", Callable::Parameter},
    {"torch", "Size", Callable::Size},
    {"torch", "device", Callable::Device},
    {"torch", "Tensor", Callable::TensorType},
    {"_codecs", "encode", Callable::Encode},
    {"builtins", "bytearray", Callable::Bytearray},
    {"builtins", "set", Callable::Set},
    {"builtins", "complex", Callable::Complex},
    {"torch.serialization", "_get_layout", Callable::Layout},
    {"torch.storage", "UntypedStorage", Callable::UntypedStorage},
    {"torch._utils", "_rebuild_tensor", Callable::RebuildTensor},
    {"torch._utils", "_rebuild_tensor_v2", Callable::RebuildTensorV2},
    {"torch._utils", "_rebuild_tensor_v3", Callable::RebuildTensorV3},
    {"torch._utils", "_rebuild_parameter", Callable::RebuildParameter},
    {"torch._utils", "_rebuild_parameter_with_state", Callable::RebuildParameterWithState},
    {"torch._tensor", "_rebuild_from_type_v2", Callable::RebuildFromTypeV2},
    // Allowed by torch, not read by vramd: refused when called, with their names.
    {"torch._utils", "_rebuild_qtensor", Callable::Unread},
    {"torch._utils", "_rebuild_sparse_tensor", Callable::Unread},
    {"torch._utils", "_rebuild_meta_tensor_no_storage", Callable::Unread},
    {"torch._utils", "_rebuild_wrapper_subclass", Callable::Unread},
    {"torch._utils", "_rebuild_device_tensor_from_numpy", Callable::Unread},
    {"torch._utils", "_rebuild_device_tensor_from_cpu_tensor", Callable::Unread},
    {"torch.storage", "TypedStorage", Callable::Unread},
};

// The globals a DCP .metadata may name beyond torch's dtypes, torch.Size and the layout getter:
// exactly the classes torch.distributed.checkpoint writes there.
constexpr AllowedGlobal kDcpGlobals[] = {
    {"torch.distributed.checkpoint.metadata", "Metadata", Callable::DcpClass},
    {"torch.distributed.checkpoint.metadata", "TensorStorageMetadata", Callable::DcpClass},
    {"torch.distributed.checkpoint.metadata", "BytesStorageMetadata", Callable::DcpClass},
    {"torch.distributed.checkpoint.metadata", "ChunkStorageMetadata", Callable::DcpClass},
    {"torch.distributed.checkpoint.metadata", "TensorProperties", Callable::DcpClass},
    {"torch.distributed.checkpoint.metadata", "MetadataIndex", Callable::DcpClass},
    {"torch.distributed.checkpoint.metadata", "StorageMeta", Callable::DcpClass},
    {"torch.distributed.checkpoint.filesystem", "_StorageInfo", Callable::DcpClass},
    {"torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", Callable::DcpEnum},
    {"pathlib", "PosixPath", Callable::Path},
    {"pathlib", "PurePosixPath", Callable::Path},
    {"torch", "Size", Callable::Size},
    {"torch.serialization", "_get_layout", Callable::Layout},
    {"collections", "OrderedDict", Callable::OrderedDict},
};

// The legacy torch.<Name>Storage classes (torch.<dtype> names: storage::parse_torch_dtype).
constexpr std::pair<std::string_view, DType> kStorageNames[] = {
    {"FloatStorage", DType::F32}, {"DoubleStorage", DType::F64}, {"HalfStorage", DType::F16},
    {"BFloat16Storage", DType::BF16}, {"LongStorage", DType::I64}, {"IntStorage", DType::I32},
    {"ShortStorage", DType::I16}, {"CharStorage", DType::I8}, {"ByteStorage", DType::U8},
    {"BoolStorage", DType::BOOL}, {"ComplexFloatStorage", DType::C64},
};

// The opcodes of torch's weights_only unpickler; the names of the others, for refusals.
constexpr std::pair<uint8_t, std::string_view> kRefusedOpcodes[] = {
    {0x95, "FRAME"}, {0x93, "STACK_GLOBAL"}, {0x94, "MEMOIZE"}, {0x8c, "SHORT_BINUNICODE"},
    {0x8d, "BINUNICODE8"}, {'B', "BINBYTES"}, {'C', "SHORT_BINBYTES"}, {0x8e, "BINBYTES8"},
    {0x96, "BYTEARRAY8"}, {'0', "POP"}, {'1', "POP_MARK"}, {'2', "DUP"}, {'I', "INT"}, {'L', "LONG"},
    {0x8b, "LONG4"}, {'S', "STRING"}, {'V', "UNICODE"}, {'F', "FLOAT"}, {'T', "BINSTRING"},
    {'P', "PERSID"}, {'g', "GET"}, {'p', "PUT"}, {'l', "LIST"}, {'d', "DICT"}, {'i', "INST"},
    {'o', "OBJ"}, {0x82, "EXT1"}, {0x83, "EXT2"}, {0x84, "EXT4"}, {0x92, "NEWOBJ_EX"},
    {0x90, "ADDITEMS"}, {0x91, "FROZENSET"}, {0x97, "NEXT_BUFFER"}, {0x98, "READONLY_BUFFER"},
};

}  // namespace

class Unpickler::Machine {
 public:
  Machine(std::string_view data, Dialect dialect) : data_(data), dialect_(dialect) {
    none_.kind = Kind::None;
    true_.kind = false_.kind = Kind::Bool;
    true_.number = 1;
  }

  std::vector<StorageEntry> storages;
  std::vector<TensorEntry> tensors;

  Value* run() {
    while (true) {
      op_at_ = position_;
      const uint8_t op = byte();
      switch (op) {
        case 0x80: {  // PROTO
          const uint8_t protocol = byte();
          if (protocol < 2 || protocol > 5) refuse("pickle protocol " + std::to_string(protocol) + " is not one Python writes");
          break;
        }
        case '.': return pop();  // STOP
        case '(': mark(); break;
        case 'N': push(&none_); break;
        case 0x88: push(&true_); break;   // NEWTRUE
        case 0x89: push(&false_); break;  // NEWFALSE
        case 'J': push(integer(static_cast<int32_t>(little(4)))); break;  // BININT
        case 'K': push(integer(static_cast<int64_t>(little(1)))); break;  // BININT1
        case 'M': push(integer(static_cast<int64_t>(little(2)))); break;  // BININT2
        case 0x8a: push(integer(long_int(byte()))); break;                 // LONG1
        case 'G': bytes(8); push(make(Kind::Float)); break;                // BINFLOAT
        case 'X': push(text(bytes(little(4)))); break;                    // BINUNICODE
        case 'U': push(text(bytes(byte()))); break;  // SHORT_BINSTRING, decoded as UTF-8 as torch.load does
        case ')': push(make(Kind::Tuple)); break;    // EMPTY_TUPLE
        case 't': push(sequence(Kind::Tuple, pop_mark())); break;  // TUPLE
        case 0x85: tuple_of(1); break;
        case 0x86: tuple_of(2); break;
        case 0x87: tuple_of(3); break;
        case ']': push(make(Kind::List)); break;  // EMPTY_LIST
        case '}': push(make(Kind::Dict)); break;  // EMPTY_DICT
        case 0x8f: push(other("set")); break;     // EMPTY_SET
        case 'a': { Value* item = pop(); add_items(list_target("APPEND"), {&item, 1}); break; }
        case 'e': { auto items = pop_mark(); add_items(list_target("APPENDS"), items); break; }
        case 's': { Value* items[2]; items[1] = pop(); items[0] = pop(); add_items(dict_target("SETITEM"), items); break; }
        case 'u': { auto items = pop_mark(); if (items.size() % 2) refuse("SETITEMS with an odd number of items");
                    add_items(dict_target("SETITEMS"), items); break; }
        case 'c': {  // GLOBAL
          std::string_view module = line();
          global(module, line());
          break;
        }
        case 'R': { Value* args = pop(); Value* callable = pop(); push(call(*callable, *args)); break; }  // REDUCE
        case 0x81: { Value* args = pop(); Value* cls = pop(); push(new_object(*cls, *args)); break; }   // NEWOBJ
        case 'b': { Value* state = pop(); build(*top(), *state); break; }                                // BUILD
        case 'Q': push(persistent(*pop())); break;  // BINPERSID
        case 0x95:  // FRAME: a hint of the next frame's length, in protocol 4
          if (dialect_ != Dialect::DcpMetadata) refuse_opcode(op);
          little(8);
          break;
        case 0x8c:  // SHORT_BINUNICODE
          if (dialect_ != Dialect::DcpMetadata) refuse_opcode(op);
          push(text(bytes(byte())));
          break;
        case 0x8d:  // BINUNICODE8
          if (dialect_ != Dialect::DcpMetadata) refuse_opcode(op);
          push(text(bytes(little(8))));
          break;
        case 0x94:  // MEMOIZE: the next slot
          if (dialect_ != Dialect::DcpMetadata) refuse_opcode(op);
          remember(memo_.size());
          break;
        case 0x93: {  // STACK_GLOBAL
          if (dialect_ != Dialect::DcpMetadata) refuse_opcode(op);
          const Value* name = pop();
          const Value* module = pop();
          global(as_text(*module, "STACK_GLOBAL's module"), as_text(*name, "STACK_GLOBAL's name"));
          break;
        }
        case 'q': remember(little(1)); break;       // BINPUT
        case 'r': remember(little(4)); break;       // LONG_BINPUT
        case 'h': push(recall(little(1))); break;   // BINGET
        case 'j': push(recall(little(4))); break;   // LONG_BINGET
        default: refuse_opcode(op);
      }
    }
  }

  // "data.pkl at byte N: what", N the offset of the opcode being run.
  [[noreturn]] void refuse(const std::string& what) const {
    throw Error(std::string(dialect_ == Dialect::DcpMetadata ? ".metadata" : "data.pkl") + " at byte " +
                std::to_string(op_at_) + ": " + what);
  }

  [[noreturn]] void refuse_opcode(uint8_t op) const {
    std::string name = "0x" + hex(op);
    for (const auto& [code, opcode] : kRefusedOpcodes)
      if (code == op) name = std::string(opcode) + " (0x" + hex(op) + ")";
    refuse("opcode " + name + (dialect_ == Dialect::DcpMetadata ? " is not one a DCP .metadata holds; refused"
                                                                : " is refused, as torch.load(weights_only=True) refuses it"));
  }

  std::string_view as_text(const Value& value, const char* what) {
    if (value.kind != Kind::Str) refuse(std::string(what) + " is a " + describe(value) + ", not a str");
    return value.text;
  }

 private:
  static std::string hex(uint8_t value) {
    char out[3];
    std::snprintf(out, sizeof out, "%02x", value);
    return out;
  }

  // Values.
  Value* make(Kind kind) {
    count_objects(1);
    Value& value = arena_.emplace_back();
    value.kind = kind;
    return &value;
  }
  Value* integer(int64_t number) {
    Value* value = make(Kind::Int);
    value->number = number;
    return value;
  }
  Value* text(std::string_view raw) {
    if (!valid_utf8(raw)) refuse("a string is not valid UTF-8: " + quote(raw.substr(0, 64)));
    Value* value = make(Kind::Str);
    value->text = raw;
    return value;
  }
  Value* other(std::string_view what) {
    Value* value = make(Kind::Other);
    value->text = what;
    return value;
  }
  Value* sequence(Kind kind, std::vector<Value*> items) {
    Value* value = make(kind);
    count_objects(items.size());
    value->items = std::move(items);
    return value;
  }
  void count_objects(size_t count) {
    objects_ += count;
    if (objects_ > kMaxPickleObjects)
      refuse("more than " + std::to_string(kMaxPickleObjects) + " objects built (the limit)");
  }

  // Input.
  uint8_t byte() { return static_cast<uint8_t>(bytes(1)[0]); }
  std::string_view bytes(uint64_t count) {
    if (count > data_.size() - position_)
      refuse("truncated: " + std::to_string(count) + " bytes wanted, " + std::to_string(data_.size() - position_) + " left");
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
    if (count > 8) refuse("an integer of " + std::to_string(count) + " bytes, wider than 64 bits");
    uint64_t value = little(count);
    if (count < 8 && (value >> (8 * count - 1)) & 1) value |= ~uint64_t{0} << (8 * count);  // sign
    return static_cast<int64_t>(value);
  }
  std::string_view line() {
    const auto end = data_.find('\n', position_);
    if (end == std::string_view::npos) refuse("truncated: a GLOBAL without its line");
    auto out = data_.substr(position_, end - position_);
    position_ = end + 1;
    return out;
  }

  // The stack: MARK records its height, and nothing pops below the latest mark.
  void push(Value* value) {
    if (stack_.size() + marks_.size() >= kMaxPickleStack)
      refuse("the stack holds " + std::to_string(kMaxPickleStack) + " items and marks (the limit)");
    stack_.push_back(value);
  }
  void mark() {
    if (stack_.size() + marks_.size() >= kMaxPickleStack)
      refuse("the stack holds " + std::to_string(kMaxPickleStack) + " items and marks (the limit)");
    marks_.push_back(stack_.size());
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  Value* top() {
    if (stack_.size() <= floor()) refuse("the stack is empty");
    return stack_.back();
  }
  Value* pop() {
    Value* value = top();
    stack_.pop_back();
    return value;
  }
  std::vector<Value*> pop_mark() {
    if (marks_.empty()) refuse("no MARK to pop to");
    std::vector<Value*> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  void tuple_of(size_t count) {
    if (stack_.size() - floor() < count) refuse("the stack holds fewer than " + std::to_string(count) + " items");
    std::vector<Value*> items(stack_.end() - static_cast<std::ptrdiff_t>(count), stack_.end());
    stack_.resize(stack_.size() - count);
    push(sequence(Kind::Tuple, std::move(items)));
  }
  Value* list_target(const char* opcode) {
    Value* target = top();
    if (target->kind != Kind::List) refuse(std::string(opcode) + " to a " + describe(*target) + ", not a list");
    return target;
  }
  Value* dict_target(const char* opcode) {
    Value* target = top();
    if (target->kind != Kind::Dict) refuse(std::string(opcode) + " on a " + describe(*target) + ", not a dict");
    return target;
  }
  void add_items(Value* target, std::span<Value* const> items) {
    count_objects(items.size());
    target->items.insert(target->items.end(), items.begin(), items.end());
  }

  // The memo.
  void remember(uint64_t slot) {
    if (slot >= kMaxPickleMemo)
      refuse("memo slot " + std::to_string(slot) + " is past the limit of " + std::to_string(kMaxPickleMemo));
    if (slot >= memo_.size()) memo_.resize(slot + 1, nullptr);
    memo_[slot] = top();
  }
  Value* recall(uint64_t slot) {
    if (slot >= memo_.size() || !memo_[slot]) refuse("memo slot " + std::to_string(slot) + " was never stored");
    return memo_[slot];
  }

  void global(std::string_view module, std::string_view name) {
    if (module == "__builtin__") module = "builtins";  // protocol 2 spells it the Python 2 way
    Value* value = make(Kind::Global);
    value->text = module;
    value->name = name;
    const bool dcp = dialect_ == Dialect::DcpMetadata;
    for (const auto& allowed : dcp ? std::span<const AllowedGlobal>(kDcpGlobals) : std::span<const AllowedGlobal>(kGlobals))
      if (allowed.module == module && allowed.name == name) {
        value->callable = allowed.callable;
        return push(value);
      }
    if (dcp) {
      if (module == "torch")
        if (const auto dtype = parse_torch_dtype(name)) {
          value->callable = Callable::DTypeName;
          value->dtype = *dtype;
          return push(value);
        }
      refuse("global " + quote(std::string(module) + "." + std::string(name)) +
             " is not one of the classes torch.distributed.checkpoint writes in its .metadata; refused without loading it");
    }
    if (module == "torch") {
      if (const auto dtype = parse_torch_dtype(name)) {
        value->callable = Callable::DTypeName;
        value->dtype = *dtype;
        return push(value);
      }
      for (const auto& [spelling, dtype] : kStorageNames)
        if (spelling == name) {
          value->callable = Callable::TypedStorage;
          value->dtype = dtype;
          return push(value);
        }
    }
    refuse("GLOBAL " + quote(std::string(module) + "." + std::string(name)) +
           " is not a global torch.load(weights_only=True) allows that vramd reads; refused without loading it");
  }

  const Value& arg(const Value& args, size_t i) { return *args.items[i]; }
  int64_t as_int(const Value& value, const char* what) {
    if (value.kind != Kind::Int) refuse(std::string(what) + " is a " + describe(value) + ", not an int");
    return value.number;
  }
  std::vector<int64_t> int_tuple(const Value& value, const char* what) {
    if (value.kind != Kind::Tuple) refuse(std::string(what) + " is a " + describe(value) + ", not a tuple");
    std::vector<int64_t> out;
    out.reserve(value.items.size());
    for (const Value* item : value.items) out.push_back(as_int(*item, what));
    return out;
  }
  void arity(const Value& args, std::string_view name, size_t least, size_t most) {
    if (args.items.size() < least || args.items.size() > most)
      refuse(std::string(name) + " called with " + std::to_string(args.items.size()) + " arguments");
  }

  Value* call(const Value& callable, const Value& args) {
    if (callable.kind != Kind::Global) refuse("REDUCE calls a " + describe(callable));
    if (args.kind != Kind::Tuple) refuse("REDUCE with a " + describe(args) + " of arguments, not a tuple");
    const std::string name = describe(callable);
    switch (callable.callable) {
      case Callable::OrderedDict:
      case Callable::Counter: return dict_from(callable.callable == Callable::OrderedDict, args, name);
      case Callable::Size: {
        arity(args, name, 1, 1);
        int_tuple(arg(args, 0), "torch.Size's argument");
        return args.items[0];
      }
      case Callable::Device:
        arity(args, name, 1, 2);
        as_text(arg(args, 0), "a device type");
        if (args.items.size() == 2) as_int(arg(args, 1), "a device index");
        return other("device");
      case Callable::Encode:
        arity(args, name, 2, 2);
        as_text(arg(args, 0), "the text of bytes");
        if (as_text(arg(args, 1), "an encoding") != "latin1") refuse(name + " with an encoding other than latin1");
        return other("bytes");
      case Callable::Bytearray:
        arity(args, name, 0, 1);
        if (!args.items.empty() && (arg(args, 0).kind != Kind::Other || arg(args, 0).text != "bytes"))
          refuse(name + " of a " + describe(arg(args, 0)));
        return other("bytearray");
      case Callable::Set:
        arity(args, name, 0, 1);
        if (!args.items.empty() && arg(args, 0).kind != Kind::List) refuse(name + " of a " + describe(arg(args, 0)));
        return other("set");
      case Callable::Complex:
        arity(args, name, 2, 2);
        for (const Value* part : args.items)
          if (part->kind != Kind::Float && part->kind != Kind::Int) refuse(name + " of a " + describe(*part));
        return other("complex");
      case Callable::Layout:
        arity(args, name, 1, 1);
        if (as_text(arg(args, 0), "a layout") != "torch.strided") refuse("layout " + quote(arg(args, 0).text) + " is not read");
        return other("layout");
      case Callable::RebuildTensor: return rebuild_tensor(args, name, 4, 4, false);
      case Callable::RebuildTensorV2: return rebuild_tensor(args, name, 6, 7, false);
      case Callable::RebuildTensorV3: return rebuild_tensor(args, name, 7, 8, true);
      case Callable::RebuildParameter:
      case Callable::RebuildParameterWithState: {
        const bool with_state = callable.callable == Callable::RebuildParameterWithState;
        arity(args, name, with_state ? 4 : 3, with_state ? 4 : 3);
        if (arg(args, 0).kind != Kind::Tensor) refuse(name + " of a " + describe(arg(args, 0)) + ", not a tensor");
        if (arg(args, 1).kind != Kind::Bool) refuse(name + ": requires_grad is a " + describe(arg(args, 1)));
        no_hooks(arg(args, 2), name);
        if (with_state && arg(args, 3).kind != Kind::Dict && arg(args, 3).kind != Kind::None && arg(args, 3).kind != Kind::Tuple)
          refuse(name + ": its state is a " + describe(arg(args, 3)));
        return args.items[0];
      }
      case Callable::RebuildFromTypeV2: {
        arity(args, name, 4, 4);
        const Value& type = arg(args, 1);
        if (type.kind != Kind::Global || (type.callable != Callable::TensorType && type.callable != Callable::Parameter))
          refuse("tensor subclass " + describe(type) + " is not read");
        if (arg(args, 3).kind != Kind::Dict && arg(args, 3).kind != Kind::None && arg(args, 3).kind != Kind::Tuple)
          refuse(name + ": its state is a " + describe(arg(args, 3)));
        const Value& rebuild = arg(args, 0);
        if (rebuild.kind == Kind::Global && rebuild.callable == Callable::RebuildFromTypeV2)
          refuse(name + " nested in itself");
        Value* tensor = call(rebuild, arg(args, 2));
        if (tensor->kind != Kind::Tensor) refuse(name + " rebuilds a " + describe(*tensor) + ", not a tensor");
        return tensor;
      }
      case Callable::Parameter: return new_object(callable, args);
      case Callable::DcpEnum:
        arity(args, name, 1, 1);
        as_int(arg(args, 0), "a memory format");
        return other("memory_format");
      case Callable::Path:
        for (const Value* part : args.items) as_text(*part, "a part of a path");
        return other("path");
      case Callable::Unread:
        refuse("calls " + name + ", which torch allows but vramd does not read (quantized, sparse, meta or subclass "
               "tensors); refused");
      default: refuse("calls " + name + ", which cannot be called in a checkpoint");
    }
  }

  Value* dict_from(bool ordered, const Value& args, const std::string& name) {
    arity(args, name, 0, 1);
    Value* dict = make(Kind::Dict);
    dict->ordered = ordered;
    if (args.items.empty()) return dict;
    const Value& source = arg(args, 0);
    if (source.kind == Kind::Dict) {
      add_items(dict, source.items);
    } else if (source.kind == Kind::List || source.kind == Kind::Tuple) {
      for (const Value* pair : source.items) {
        if ((pair->kind != Kind::Tuple && pair->kind != Kind::List) || pair->items.size() != 2)
          refuse(name + " of an item that is a " + describe(*pair) + ", not a pair");
        add_items(dict, pair->items);
      }
    } else {
      refuse(name + " of a " + describe(source));
    }
    return dict;
  }

  void no_hooks(const Value& hooks, const std::string& name) {
    if (hooks.kind != Kind::Dict || !hooks.items.empty())
      refuse(name + ": backward hooks must be an empty OrderedDict, found a " + describe(hooks) +
             (hooks.kind == Kind::Dict ? " of " + std::to_string(hooks.items.size() / 2) + " items" : ""));
  }

  Value* new_object(const Value& cls, const Value& args) {
    if (cls.kind == Kind::Global && cls.callable == Callable::DcpClass) {
      if (args.kind != Kind::Tuple || !args.items.empty()) refuse("NEWOBJ of " + describe(cls) + " with arguments");
      Value* object = make(Kind::Object);
      object->name = cls.name;
      return object;
    }
    if (cls.kind != Kind::Global || cls.callable != Callable::Parameter)
      refuse("NEWOBJ of " + describe(cls) + "; only torch.nn.Parameter is built this way");
    if (args.kind != Kind::Tuple || args.items.empty() || args.items.size() > 2 || arg(args, 0).kind != Kind::Tensor ||
        (args.items.size() == 2 && arg(args, 1).kind != Kind::Bool))
      refuse("torch.nn.Parameter built from something other than (tensor[, requires_grad])");
    return args.items[0];
  }

  // torch's weights_only BUILD sets an OrderedDict's attributes (its _metadata); a legacy
  // tensor or Parameter state would change what the tensor holds, which vramd does not model.
  void build(Value& target, Value& state) {
    if (target.kind == Kind::Object) {  // a DCP dataclass: its fields, by name or in order
      if (!target.items.empty()) refuse("BUILD on " + describe(target) + " twice");
      if (state.kind != Kind::Dict && state.kind != Kind::Tuple)
        refuse("BUILD on " + describe(target) + " with a " + describe(state) + " of fields");
      for (size_t i = 0; state.kind == Kind::Dict && i < state.items.size(); i += 2)
        as_text(*state.items[i], "a field name");
      target.items = {&state};
      return;
    }
    if (target.kind != Kind::Dict || !target.ordered)
      refuse("BUILD on a " + describe(target) + "; only an OrderedDict's attributes may be set");
    if (state.kind == Kind::None) return;
    if (state.kind != Kind::Dict) refuse("BUILD on an OrderedDict with a " + describe(state) + " of attributes");
    for (size_t i = 0; i < state.items.size(); i += 2) {
      const std::string_view attribute = as_text(*state.items[i], "an attribute name");
      if (attribute.starts_with("__"))
        refuse("BUILD sets the attribute " + quote(attribute) + " on an OrderedDict; only plain attributes such as "
               "_metadata may be set");
    }
  }

  Value* persistent(const Value& id) {
    if (id.kind != Kind::Tuple || id.items.size() != 5 || id.items[0]->kind != Kind::Str || id.items[0]->text != "storage")
      refuse("persistent id " + describe(id) + (id.kind == Kind::Tuple ? " of " + std::to_string(id.items.size()) + " items" : "") +
             " is not ('storage', type, key, location, size)");
    const Value& type = arg(id, 1);
    if (type.kind != Kind::Global || (type.callable != Callable::TypedStorage && type.callable != Callable::UntypedStorage))
      refuse("storage type " + describe(type) + " is not read (vramd reads " +
             "torch.storage.UntypedStorage and the typed storages of the dtypes it supports)");
    const std::string_view key = as_text(arg(id, 2), "a storage key");
    as_text(arg(id, 3), "a storage location");
    const int64_t size = as_int(arg(id, 4), "a storage size");
    if (size < 0) refuse("storage " + quote(key) + " has a negative size");
    const std::string_view type_name = type.name;

    auto [known, fresh] = storage_index_.try_emplace(key, static_cast<uint32_t>(storages.size()));
    if (!fresh) {
      const StorageEntry& entry = storages[known->second];
      if (entry.type != type_name || entry.declared != static_cast<uint64_t>(size))
        refuse("storage " + quote(key) + " is declared as " + std::string(entry.type) + " of " +
               std::to_string(entry.declared) + ", then as " + std::string(type_name) + " of " + std::to_string(size));
    } else {
      StorageEntry entry;
      entry.key = key;
      entry.type = type_name;
      entry.untyped = type.callable == Callable::UntypedStorage;
      entry.dtype_fixed = !entry.untyped;
      entry.dtype = entry.untyped ? DType::U8 : type.dtype;
      entry.declared = static_cast<uint64_t>(size);
      if (__builtin_mul_overflow(entry.declared, uint64_t{dtype_bits(entry.dtype) / 8}, &entry.bytes))
        refuse("storage " + quote(key) + " has a size that overflows");
      storages.push_back(entry);
    }
    Value* value = make(Kind::Storage);
    value->index = known->second;
    return value;
  }

  Value* rebuild_tensor(const Value& args, const std::string& name, size_t least, size_t most, bool explicit_dtype) {
    arity(args, name, least, most);
    if (arg(args, 0).kind != Kind::Storage) refuse(name + " of a " + describe(arg(args, 0)) + ", not a storage");
    TensorEntry tensor;
    tensor.storage = arg(args, 0).index;
    StorageEntry& storage = storages[tensor.storage];
    tensor.offset = as_int(arg(args, 1), "a storage offset");
    tensor.shape = int_tuple(arg(args, 2), "a shape");
    tensor.stride = int_tuple(arg(args, 3), "strides");
    if (args.items.size() > 4) {
      if (arg(args, 4).kind != Kind::Bool) refuse(name + ": requires_grad is a " + describe(arg(args, 4)));
      no_hooks(arg(args, 5), name);
    }
    DType dtype = storage.dtype;
    if (explicit_dtype) {
      const Value& given = arg(args, 6);
      if (given.kind != Kind::Global || given.callable != Callable::DTypeName)
        refuse(name + ": dtype " + describe(given) + " is not one vramd reads");
      dtype = given.dtype;
    }
    const size_t metadata = explicit_dtype ? 7 : 6;
    if (args.items.size() > metadata) {
      const Value& extra = arg(args, metadata);
      if (extra.kind != Kind::None && (extra.kind != Kind::Dict || !extra.items.empty()))
        refuse(name + ": tensor metadata (" + describe(extra) + ") would change how the data reads; not supported");
    }
    const std::string what = "tensor in storage " + quote(storage.key);
    if (!storage.dtype_fixed) {
      storage.dtype = dtype;
      storage.dtype_fixed = true;
    } else if (storage.dtype != dtype) {
      refuse(what + " is read as " + std::string(dtype_name(dtype)) + ", but the storage is " +
             std::string(dtype_name(storage.dtype)));
    }
    tensor.dtype = dtype;
    const uint64_t item = dtype_bits(dtype) / 8;
    if (storage.bytes % item)
      refuse(what + ": its " + std::to_string(storage.bytes) + " bytes are not a whole number of " +
             std::string(dtype_name(dtype)) + " elements");
    if (tensor.shape.size() != tensor.stride.size())
      refuse(what + " has " + std::to_string(tensor.shape.size()) + " sizes but " + std::to_string(tensor.stride.size()) +
             " strides");
    if (tensor.offset < 0) refuse(what + " has a negative storage offset");
    // The last element it reaches, checked against the storage on every use of the key.
    bool empty = false;
    for (int64_t size : tensor.shape) {
      if (size < 0) refuse(what + " has a negative size in " + format_shape(tensor.shape));
      empty = empty || size == 0;
    }
    if (!empty) {
      uint64_t last = static_cast<uint64_t>(tensor.offset);
      for (size_t i = 0; i < tensor.shape.size(); ++i) {
        if (tensor.stride[i] < 0) refuse(what + " has a negative stride in " + format_shape(tensor.stride));
        uint64_t reach = 0;
        if (__builtin_mul_overflow(static_cast<uint64_t>(tensor.shape[i] - 1), static_cast<uint64_t>(tensor.stride[i]), &reach) ||
            __builtin_add_overflow(last, reach, &last))
          refuse(what + " with shape " + format_shape(tensor.shape) + " reaches past any storage");
      }
      if (last >= storage.bytes / item)
        refuse(what + " (offset " + std::to_string(tensor.offset) + ", shape " + format_shape(tensor.shape) + ", strides " +
               format_shape(tensor.stride) + ") reaches element " + std::to_string(last) + ", past the storage's " +
               std::to_string(storage.bytes / item) + " " + std::string(dtype_name(dtype)) + " elements");
    }
    tensors.push_back(std::move(tensor));
    Value* value = make(Kind::Tensor);
    value->index = static_cast<uint32_t>(tensors.size() - 1);
    return value;
  }

  std::deque<Value> arena_;  // owns every value: a pickle may build cycles
  Value none_, true_, false_;
  std::string_view data_;
  Dialect dialect_;
  size_t position_ = 0, op_at_ = 0, objects_ = 0;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::vector<Value*> memo_;
  std::unordered_map<std::string_view, uint32_t> storage_index_;
};

Unpickler::Unpickler(std::string_view data, Dialect dialect) : machine_(std::make_unique<Machine>(data, dialect)) {}
Unpickler::~Unpickler() = default;
Value* Unpickler::run() { return machine_->run(); }
const std::vector<StorageEntry>& Unpickler::storages() const { return machine_->storages; }
const std::vector<TensorEntry>& Unpickler::tensors() const { return machine_->tensors; }

}  // namespace vramd::storage::pickle
