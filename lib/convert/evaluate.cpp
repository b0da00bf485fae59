#include "convert/evaluate.hpp"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include "storage/dequantize_ops.hpp"
#include "storage/tensor_io.hpp"
#include "util/error.hpp"

namespace vramd::convert {
namespace {

// `packed`: the block type whose bytes the sources are read as (packed_type() accepted the
// expression), so a reshape takes the packed shape of its result.
// `changed`: sources whose values are not as stored (evaluate()).
at::Tensor value(const Expr& expr, const storage::DiskMap& map, storage::ReadMode mode,
                 std::optional<storage::DType> packed, const SourceValue& changed) {
  auto input = [&](size_t i) { return value(*expr.inputs.at(i), map, mode, packed, changed); };
  auto all = [&] {
    std::vector<at::Tensor> tensors;
    for (const auto& part : expr.inputs) tensors.push_back(value(*part, map, mode, packed, changed));
    return tensors;
  };
  const std::optional<c10::ScalarType> read_as = packed ? std::optional(c10::kByte) : std::nullopt;
  switch (expr.op) {
    case Expr::Op::Source:
      if (changed)
        if (at::Tensor own = changed(expr); own.defined()) return own;
      return storage::load_tensor(map, map.at(expr.source, expr.shard), {.dtype = read_as, .mode = mode});
    case Expr::Op::Zeros: return at::zeros(expr.shape, at::TensorOptions().dtype(storage::scalar_type(expr.dtype)));
    case Expr::Op::Transpose: return input(0).transpose(expr.args[0], expr.args[1]);
    case Expr::Op::Permute: return input(0).permute(expr.args);
    case Expr::Op::Reshape: return input(0).reshape(packed ? storage::packed_shape(*packed, expr.shape) : expr.args);
    case Expr::Op::Narrow: {
      // Rows of a stored tensor: read those rows alone. A view of the whole would do where the
      // data is aligned, but a tensor that is not (a DCP chunk inside its archive) is copied,
      // and the copy would read every row.
      const Expr& from = *expr.inputs.at(0);
      if (expr.args[0] == 0 && !packed && !changed && from.op == Expr::Op::Source) {
        storage::TensorInfo rows = map.at(from.source, from.shard);
        if (storage::dtype_block(rows.dtype) == 1 && !rows.shape.empty() && rows.shape[0] > 0) {
          const uint64_t row = rows.nbytes / static_cast<uint64_t>(rows.shape[0]);
          rows.offset += static_cast<uint64_t>(expr.args[1]) * row;
          rows.nbytes = static_cast<uint64_t>(expr.args[2]) * row;
          rows.shape[0] = expr.args[2];
          return storage::load_tensor(map, rows, {.dtype = read_as, .mode = mode});
        }
      }
      return input(0).narrow(expr.args[0], expr.args[1], expr.args[2]);
    }
    case Expr::Op::Cat:
      if (expr.args[0] == 0 && !packed && !changed) {  // sources as stored, one after another: read in place
        std::vector<const storage::TensorInfo*> parts;
        for (const auto& part : expr.inputs) {
          const auto* info = part->op == Expr::Op::Source ? &map.at(part->source, part->shard) : nullptr;
          if (!info || info->dtype != expr.dtype) break;
          parts.push_back(info);
        }
        if (parts.size() == expr.inputs.size()) {
          at::Tensor out = at::empty(expr.shape, at::TensorOptions().dtype(storage::scalar_type(expr.dtype)));
          auto* cursor = static_cast<std::byte*>(out.mutable_data_ptr());
          for (const auto* info : parts) {
            map.read(*info, {cursor, info->nbytes});
            cursor += info->nbytes;
          }
          return out;
        }
      }
      return at::cat(all(), expr.args[0]);
    case Expr::Op::Stack: return at::stack(all(), expr.args[0]);
    case Expr::Op::Cast: return input(0).to(storage::scalar_type(expr.dtype));
    case Expr::Op::Scale: return input(0).mul(expr.factor);
    case Expr::Op::Shift: return input(0).add(expr.factor);
  }
  throw Error("unknown expression");
}

// Whether the op leaves the last dimension of its operands (of `rank` dimensions) whole and in
// place, so that it moves whole rows of blocks.
bool moves_rows(const Expr& expr, int64_t rank) {
  const int64_t last = rank - 1;
  switch (expr.op) {
    case Expr::Op::Source: return true;
    case Expr::Op::Transpose: return expr.args[0] == expr.args[1] || (expr.args[0] != last && expr.args[1] != last);
    case Expr::Op::Permute: return expr.args.back() == last;
    case Expr::Op::Reshape:
      return !expr.shape.empty() && rank > 0 && expr.shape.back() == expr.inputs[0]->shape.back();
    case Expr::Op::Narrow:
    case Expr::Op::Cat: return expr.args[0] != last;
    case Expr::Op::Stack: return expr.args[0] != rank;  // a new last dimension would split rows
    case Expr::Op::Zeros:
    case Expr::Op::Cast:
    case Expr::Op::Scale:
    case Expr::Op::Shift: return false;
  }
  return false;
}

}  // namespace

at::Tensor evaluate(const Expr& expr, const storage::DiskMap& source, storage::ReadMode mode,
                    const SourceValue& changed) {
  return value(expr, source, mode, std::nullopt, changed).contiguous();
}

std::optional<storage::DType> packed_type(const Expr& expr, const storage::DiskMap& source) {
  if (expr.op == Expr::Op::Source) {
    const storage::DType stored = source.at(expr.source, expr.shard).dtype;
    return storage::dtype_block(stored) != 1 ? std::optional(stored) : std::nullopt;
  }
  if (expr.inputs.empty() || !moves_rows(expr, static_cast<int64_t>(expr.inputs[0]->shape.size()))) return std::nullopt;
  std::optional<storage::DType> type;
  for (const auto& input : expr.inputs) {
    const auto inner = packed_type(*input, source);
    if (!inner || (type && *type != *inner)) return std::nullopt;
    type = inner;
  }
  return type;
}

at::Tensor evaluate_packed(const Expr& expr, const storage::DiskMap& source, storage::ReadMode mode) {
  const auto type = packed_type(expr, source);
  if (!type) throw Error("the value of " + expr.describe() + " cannot stay packed: it reads no GGUF block type, "
                         "or its operations split the rows of blocks");
  return value(expr, source, mode, type, {}).contiguous();
}

}  // namespace vramd::convert
