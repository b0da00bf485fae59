// Lazy tensor expressions: what a converter returns for each target key. Building one checks
// shapes and dtypes and computes the result's, without reading a byte of tensor data; each
// node remembers which source keys it reads. Evaluation is in convert/evaluate.hpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "storage/dtype.hpp"

namespace vramd::convert {

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

struct Expr {
  enum class Op { Source, Zeros, Transpose, Permute, Reshape, Narrow, Cat, Stack, Cast, Scale, Shift };
  Op op;
  std::vector<ExprPtr> inputs;
  std::string source;         // Op::Source: the key in the source checkpoint
  uint32_t shard = 0;         // Op::Source: which file's slice of it (DiskMap::shards), in file order
  uint32_t shards = 1;        // Op::Source: how many files hold a slice of it
  std::vector<int64_t> args;  // dims (Transpose, Permute), shape (Reshape), dim/start/length (Narrow), dim (Cat, Stack)
  double factor = 1;          // Op::Scale: what it multiplies by; Op::Shift: what it adds
  storage::DType dtype;       // of the result
  std::vector<int64_t> shape;

  // "narrow(t(src['h.0.attn.c_attn.weight']), 0, 0, 768)"; a shard: "src:shards('wq')[2]"
  std::string describe() const;
  // The source keys it reads, in order, each once.
  std::vector<std::string> sources() const;
  // Calls `visit` with every source node, depth first (a key read twice, twice).
  template <typename Visit>
  void for_each_source(Visit&& visit) const {
    if (op == Op::Source) return visit(*this);  // most targets: no stack to allocate
    std::vector<const Expr*> pending = {this};
    while (!pending.empty()) {
      const Expr* expr = pending.back();
      pending.pop_back();
      if (expr->op == Op::Source) visit(*expr);
      for (auto it = expr->inputs.rbegin(); it != expr->inputs.rend(); ++it) pending.push_back(it->get());
    }
  }
};

// Each throws Error naming the operation, its operands' sources and shapes, and what is wrong.
// `shard` of `shards`: the slice of the key in one of several files that each hold a slice.
ExprPtr source(std::string key, storage::DType dtype, std::vector<int64_t> shape, uint32_t shard = 0,
               uint32_t shards = 1);
// A tensor of zeros, read from nowhere: a weight a checkpoint leaves out because it is zero (a
// bias of a model trained without biases).
ExprPtr zeros(std::vector<int64_t> shape, storage::DType dtype);
ExprPtr transpose(const ExprPtr& input, int64_t dim0, int64_t dim1);
ExprPtr permute(const ExprPtr& input, std::vector<int64_t> dims);
ExprPtr reshape(const ExprPtr& input, std::vector<int64_t> shape);  // one dimension may be -1
ExprPtr narrow(const ExprPtr& input, int64_t dim, int64_t start, int64_t length);
std::vector<ExprPtr> chunk(const ExprPtr& input, int64_t chunks, int64_t dim);  // equal parts only
std::vector<ExprPtr> split(const ExprPtr& input, const std::vector<int64_t>& sizes, int64_t dim);
ExprPtr cat(const std::vector<ExprPtr>& inputs, int64_t dim);
ExprPtr stack(const std::vector<ExprPtr>& inputs, int64_t dim);
ExprPtr cast(const ExprPtr& input, storage::DType dtype);
ExprPtr scale(const ExprPtr& input, double factor);
// The input plus a number: GGUF's Gemma norms, stored plus one.
ExprPtr shift(const ExprPtr& input, double addend);

// "float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2", "int64", "int32",
// "int16", "int8", "uint8", "bool", or a safetensors name ("BF16").
storage::DType parse_dtype_name(const std::string& name);
std::string dtype_torch_name(storage::DType dtype);

}  // namespace vramd::convert
