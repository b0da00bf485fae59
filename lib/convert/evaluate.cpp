#include "convert/evaluate.hpp"

#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include "storage/tensor_io.hpp"
#include "util/error.hpp"

namespace vramd::convert {
namespace {

at::Tensor value(const Expr& expr, const storage::DiskMap& map, storage::ReadMode mode) {
  auto input = [&](size_t i) { return value(*expr.inputs.at(i), map, mode); };
  auto all = [&] {
    std::vector<at::Tensor> tensors;
    for (const auto& part : expr.inputs) tensors.push_back(value(*part, map, mode));
    return tensors;
  };
  switch (expr.op) {
    case Expr::Op::Source: return storage::load_tensor(map, map.at(expr.source, expr.shard), {.dtype = std::nullopt, .mode = mode});
    case Expr::Op::Zeros: return at::zeros(expr.shape, at::TensorOptions().dtype(storage::scalar_type(expr.dtype)));
    case Expr::Op::Transpose: return input(0).transpose(expr.args[0], expr.args[1]);
    case Expr::Op::Permute: return input(0).permute(expr.args);
    case Expr::Op::Reshape: return input(0).reshape(expr.args);
    case Expr::Op::Narrow: return input(0).narrow(expr.args[0], expr.args[1], expr.args[2]);
    case Expr::Op::Cat: return at::cat(all(), expr.args[0]);
    case Expr::Op::Stack: return at::stack(all(), expr.args[0]);
    case Expr::Op::Cast: return input(0).to(storage::scalar_type(expr.dtype));
    case Expr::Op::Scale: return input(0).mul(expr.factor);
  }
  throw Error("unknown expression");
}

}  // namespace

at::Tensor evaluate(const Expr& expr, const storage::DiskMap& source, storage::ReadMode mode) {
  return value(expr, source, mode).contiguous();
}

}  // namespace vramd::convert
