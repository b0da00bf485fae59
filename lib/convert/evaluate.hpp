// Evaluating a converter's lazy expressions on LibTorch: the moment tensor data is read.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>

#include "convert/expr.hpp"
#include "storage/disk_map.hpp"
#include "storage/tensor_io.hpp"

namespace vramd::convert {

// The expression's value as a contiguous CPU tensor. Sources are read as zero-copy views of
// the file mapping, so only the pages an expression touches are read: a narrow() of a fused
// weight reads its slice and no more. Works the same each time it is called, so weights can
// be re-read from disk on every use. With ReadMode::Copy sources are read into fresh memory
// instead, so the result never points into the file. `changed`, where given, is asked for each
// source's value first: a defined tensor is used in place of the stored one (a LoRA adapter's
// terms fused into it, weights/source.cpp), an undefined one means read it as stored.
using SourceValue = std::function<at::Tensor(const Expr& source)>;
at::Tensor evaluate(const Expr& expr, const storage::DiskMap& source, storage::ReadMode mode = storage::ReadMode::Auto,
                    const SourceValue& changed = {});

// The GGUF block type in which the expression's value can stay packed: every source it reads
// holds that type, and every op moves whole rows (none touches the last dimension, along which
// the blocks run), so that applied to the packed bytes it gives the value's packed bytes, as
// gguf.lua's reordering of LLaMA's q and k rows does. nullopt for any other expression.
std::optional<storage::DType> packed_type(const Expr& expr, const storage::DiskMap& source);

// The value of an expression packed_type() accepts, packed: uint8, contiguous, shaped
// storage::packed_shape (storage/dequantize_ops.hpp). Reads as evaluate() does.
at::Tensor evaluate_packed(const Expr& expr, const storage::DiskMap& source,
                           storage::ReadMode mode = storage::ReadMode::Auto);

}  // namespace vramd::convert
