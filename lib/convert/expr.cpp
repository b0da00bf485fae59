#include "convert/expr.hpp"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <set>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::convert {
namespace {

using storage::DType;

// The dtypes a converter may name in LibTorch's spelling (cast(), describe()).
constexpr DType kNamed[] = {DType::F32, DType::BF16, DType::F16, DType::F64, DType::F8_E4M3, DType::F8_E5M2,
                            DType::I64, DType::I32, DType::I16, DType::I8, DType::U8, DType::BOOL};

// "src['x'] of shape [2, 3]" or "an expression of shape [2, 3]", for messages.
std::string operand(const Expr& expr) {
  auto keys = expr.sources();
  std::string from;
  for (const auto& key : keys) from += (from.empty() ? "" : ", ") + quote(key);
  return (expr.op == Expr::Op::Source ? expr.describe() : "an expression of " + from) +
         " (shape " + format_shape(expr.shape) + ")";
}

[[noreturn]] void refuse(const std::string& operation, const Expr& input, const std::string& problem) {
  throw Error(operation + " of " + operand(input) + ": " + problem);
}

int64_t normalize_dim(const std::string& operation, const Expr& input, int64_t dim, int64_t rank) {
  const int64_t normalized = dim < 0 ? dim + rank : dim;
  if (normalized < 0 || normalized >= rank)
    refuse(operation, input, "dimension " + std::to_string(dim) + " is out of range for " + std::to_string(rank) +
                                 " dimensions (counted from 0)");
  return normalized;
}

std::shared_ptr<Expr> node(Expr::Op op, std::vector<ExprPtr> inputs) {
  auto expr = std::make_shared<Expr>();
  expr->op = op;
  expr->inputs = std::move(inputs);
  expr->dtype = expr->inputs.empty() ? DType::F32 : expr->inputs[0]->dtype;
  return expr;
}

bool is_float(DType dtype) {
  switch (dtype) {
    case DType::F16: case DType::BF16: case DType::F32: case DType::F64:
    case DType::F8_E4M3: case DType::F8_E5M2: return true;
    default: return false;
  }
}

std::string list_text(const std::vector<int64_t>& values) { return format_shape(values); }

}  // namespace

std::string Expr::describe() const {
  auto first = [&] { return inputs.at(0)->describe(); };
  auto many = [&] {
    std::string text = "[";
    for (size_t i = 0; i < inputs.size(); ++i) text += (i ? ", " : "") + inputs[i]->describe();
    return text + "]";
  };
  switch (op) {
    case Op::Source:
      return shards > 1 ? "src:shards(" + quote(source) + ")[" + std::to_string(shard + 1) + "]"
                        : "src[" + quote(source) + "]";
    case Op::Zeros: return "zeros(" + list_text(shape) + ", " + dtype_torch_name(dtype) + ")";
    case Op::Transpose: return "transpose(" + first() + ", " + std::to_string(args[0]) + ", " + std::to_string(args[1]) + ")";
    case Op::Permute: return "permute(" + first() + ", " + list_text(args) + ")";
    case Op::Reshape: return "reshape(" + first() + ", " + list_text(args) + ")";
    case Op::Narrow:
      return "narrow(" + first() + ", " + std::to_string(args[0]) + ", " + std::to_string(args[1]) + ", " +
             std::to_string(args[2]) + ")";
    case Op::Cat: return "cat(" + many() + ", " + std::to_string(args[0]) + ")";
    case Op::Stack: return "stack(" + many() + ", " + std::to_string(args[0]) + ")";
    case Op::Cast: return "cast(" + first() + ", " + dtype_torch_name(dtype) + ")";
    case Op::Scale:
    case Op::Shift: {
      char factor_text[32];
      std::snprintf(factor_text, sizeof factor_text, "%.9g", factor);
      return (op == Op::Scale ? "scale(" : "shift(") + first() + ", " + factor_text + ")";
    }
  }
  return "?";
}

std::vector<std::string> Expr::sources() const {
  std::vector<std::string> out;
  for_each_source([&](const Expr& node) {
    if (std::find(out.begin(), out.end(), node.source) == out.end()) out.push_back(node.source);
  });
  return out;
}

ExprPtr source(std::string key, DType dtype, std::vector<int64_t> shape, uint32_t shard, uint32_t shards) {
  auto expr = node(Expr::Op::Source, {});
  expr->source = std::move(key);
  expr->shard = shard;
  expr->shards = shards;
  expr->dtype = dtype;
  expr->shape = std::move(shape);
  return expr;
}

ExprPtr zeros(std::vector<int64_t> shape, DType dtype) {
  // Not read from the checkpoint, so not bounded by it: a cap keeps a script from asking for
  // more memory than any weight needs.
  constexpr uint64_t kMaxElements = uint64_t{1} << 32;
  uint64_t elements = 1;
  for (const int64_t dim : shape) {
    if (dim < 0) throw Error("zeros(" + format_shape(shape) + "): dimension " + std::to_string(dim) + " is negative");
    if (dim > 0 && elements > kMaxElements / static_cast<uint64_t>(dim))
      throw Error("zeros(" + format_shape(shape) + "): more than 2^32 elements");
    elements *= static_cast<uint64_t>(dim);
  }
  auto expr = node(Expr::Op::Zeros, {});
  expr->dtype = dtype;
  expr->shape = std::move(shape);
  return expr;
}

ExprPtr transpose(const ExprPtr& input, int64_t dim0, int64_t dim1) {
  const int64_t rank = static_cast<int64_t>(input->shape.size());
  auto expr = node(Expr::Op::Transpose, {input});
  expr->args = {normalize_dim("transpose", *input, dim0, rank), normalize_dim("transpose", *input, dim1, rank)};
  expr->shape = input->shape;
  std::swap(expr->shape[expr->args[0]], expr->shape[expr->args[1]]);
  return expr;
}

ExprPtr permute(const ExprPtr& input, std::vector<int64_t> dims) {
  const int64_t rank = static_cast<int64_t>(input->shape.size());
  if (static_cast<int64_t>(dims.size()) != rank)
    refuse("permute", *input, list_text(dims) + " names " + std::to_string(dims.size()) + " dimensions, the tensor has " +
                                  std::to_string(rank));
  std::set<int64_t> seen;
  auto expr = node(Expr::Op::Permute, {input});
  for (auto& dim : dims) {
    dim = normalize_dim("permute", *input, dim, rank);
    if (!seen.insert(dim).second) refuse("permute", *input, list_text(dims) + " names dimension " + std::to_string(dim) + " twice");
    expr->shape.push_back(input->shape[dim]);
  }
  expr->args = std::move(dims);
  return expr;
}

ExprPtr reshape(const ExprPtr& input, std::vector<int64_t> shape) {
  int64_t known = 1, inferred = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (inferred >= 0) refuse("reshape", *input, list_text(shape) + " has more than one -1");
      inferred = static_cast<int64_t>(i);
    } else if (shape[i] < 0) {
      refuse("reshape", *input, list_text(shape) + " has a negative size");
    } else {
      known *= shape[i];
    }
  }
  int64_t elements = 1;
  for (int64_t dim : input->shape) elements *= dim;
  if (inferred >= 0) {
    if (known == 0 || elements % known != 0)
      refuse("reshape", *input, "cannot fit " + std::to_string(elements) + " elements into " + list_text(shape));
    shape[inferred] = elements / known;
  } else if (known != elements) {
    refuse("reshape", *input, list_text(shape) + " holds " + std::to_string(known) + " elements, the tensor " +
                                  std::to_string(elements));
  }
  auto expr = node(Expr::Op::Reshape, {input});
  expr->args = shape;
  expr->shape = std::move(shape);
  return expr;
}

ExprPtr narrow(const ExprPtr& input, int64_t dim, int64_t start, int64_t length) {
  const int64_t rank = static_cast<int64_t>(input->shape.size());
  dim = normalize_dim("narrow", *input, dim, rank);
  if (start < 0 || length < 0 || start + length > input->shape[dim])
    refuse("narrow", *input, "elements [" + std::to_string(start) + ", " + std::to_string(start + length) +
                                 ") of dimension " + std::to_string(dim) + " are outside its size " +
                                 std::to_string(input->shape[dim]));
  if (start == 0 && length == input->shape[dim]) return input;
  // Of a cat along the same dimension, only the inputs it overlaps, narrowed: a slice of a
  // tensor joined from chunks (a DCP checkpoint's, a converter's) reads those chunks alone.
  if (input->op == Expr::Op::Cat && input->args[0] == dim) {
    std::vector<ExprPtr> parts;
    int64_t at = 0;
    for (const auto& part : input->inputs) {
      const int64_t size = part->shape[dim];
      const int64_t from = std::max(start, at), to = std::min(start + length, at + size);
      if (from < to || (length == 0 && parts.empty() && start <= at + size))
        parts.push_back(narrow(part, dim, from - at, std::max<int64_t>(to - from, 0)));
      at += size;
    }
    return parts.size() == 1 ? parts[0] : cat(parts, dim);
  }
  auto expr = node(Expr::Op::Narrow, {input});
  expr->args = {dim, start, length};
  expr->shape = input->shape;
  expr->shape[dim] = length;
  return expr;
}

std::vector<ExprPtr> chunk(const ExprPtr& input, int64_t chunks, int64_t dim) {
  const int64_t rank = static_cast<int64_t>(input->shape.size());
  dim = normalize_dim("chunk", *input, dim, rank);
  if (chunks <= 0 || input->shape[dim] % chunks != 0)
    refuse("chunk", *input, "dimension " + std::to_string(dim) + " (size " + std::to_string(input->shape[dim]) +
                                ") does not split into " + std::to_string(chunks) + " equal parts");
  return split(input, std::vector<int64_t>(static_cast<size_t>(chunks), input->shape[dim] / chunks), dim);
}

std::vector<ExprPtr> split(const ExprPtr& input, const std::vector<int64_t>& sizes, int64_t dim) {
  const int64_t rank = static_cast<int64_t>(input->shape.size());
  dim = normalize_dim("split", *input, dim, rank);
  int64_t total = 0;
  for (int64_t size : sizes) {
    if (size < 0) refuse("split", *input, "sizes " + list_text(sizes) + " include a negative size");
    total += size;
  }
  if (total != input->shape[dim])
    refuse("split", *input, "sizes " + list_text(sizes) + " add up to " + std::to_string(total) + ", dimension " +
                                std::to_string(dim) + " has " + std::to_string(input->shape[dim]));
  std::vector<ExprPtr> parts;
  int64_t start = 0;
  for (int64_t size : sizes) {
    parts.push_back(narrow(input, dim, start, size));
    start += size;
  }
  return parts;
}

ExprPtr cat(const std::vector<ExprPtr>& inputs, int64_t dim) {
  if (inputs.empty()) throw Error("cat of nothing: give at least one tensor");
  const auto& first = *inputs[0];
  const int64_t rank = static_cast<int64_t>(first.shape.size());
  dim = normalize_dim("cat", first, dim, rank);
  auto expr = node(Expr::Op::Cat, inputs);
  expr->args = {dim};
  expr->shape = first.shape;
  expr->shape[dim] = 0;
  for (const auto& input : inputs) {
    if (input->dtype != first.dtype)
      refuse("cat", *input, "its dtype " + dtype_torch_name(input->dtype) + " differs from the first tensor's " +
                                dtype_torch_name(first.dtype) + "; cast first");
    bool fits = input->shape.size() == first.shape.size();
    for (int64_t d = 0; fits && d < rank; ++d) fits = d == dim || input->shape[d] == first.shape[d];
    if (!fits) refuse("cat", *input, "does not match " + operand(first) + " outside dimension " + std::to_string(dim));
    expr->shape[dim] += input->shape[dim];
  }
  return expr;
}

ExprPtr stack(const std::vector<ExprPtr>& inputs, int64_t dim) {
  if (inputs.empty()) throw Error("stack of nothing: give at least one tensor");
  const auto& first = *inputs[0];
  const int64_t rank = static_cast<int64_t>(first.shape.size()) + 1;
  dim = normalize_dim("stack", first, dim, rank);
  for (const auto& input : inputs) {
    if (input->shape != first.shape) refuse("stack", *input, "its shape differs from " + operand(first));
    if (input->dtype != first.dtype)
      refuse("stack", *input, "its dtype " + dtype_torch_name(input->dtype) + " differs from the first tensor's " +
                                  dtype_torch_name(first.dtype) + "; cast first");
  }
  auto expr = node(Expr::Op::Stack, inputs);
  expr->args = {dim};
  expr->shape = first.shape;
  expr->shape.insert(expr->shape.begin() + dim, static_cast<int64_t>(inputs.size()));
  return expr;
}

ExprPtr cast(const ExprPtr& input, DType dtype) {
  auto expr = node(Expr::Op::Cast, {input});
  expr->dtype = dtype;
  expr->shape = input->shape;
  return expr;
}

namespace {

// Scale and shift: a number applied to every element of a floating-point tensor.
ExprPtr arithmetic(Expr::Op op, const char* what, const ExprPtr& input, double number) {
  if (!is_float(input->dtype))
    refuse(what, *input, "its dtype " + dtype_torch_name(input->dtype) + " is not a floating-point type");
  auto expr = node(op, {input});
  expr->factor = number;
  expr->shape = input->shape;
  return expr;
}

}  // namespace

ExprPtr scale(const ExprPtr& input, double factor) { return arithmetic(Expr::Op::Scale, "scale", input, factor); }

ExprPtr shift(const ExprPtr& input, double addend) { return arithmetic(Expr::Op::Shift, "shift", input, addend); }

DType parse_dtype_name(const std::string& name) {
  if (auto dtype = storage::parse_torch_dtype(name); dtype && std::ranges::find(kNamed, *dtype) != std::end(kNamed))
    return *dtype;
  if (auto dtype = storage::parse_dtype(name)) return *dtype;
  throw Error("unknown dtype " + quote(name) + " (expected float32, bfloat16, float16, float64, float8_e4m3fn, "
              "float8_e5m2, int64, int32, int16, int8, uint8 or bool)");
}

std::string dtype_torch_name(DType dtype) { return std::string(storage::torch_dtype_name(dtype)); }

}  // namespace vramd::convert
