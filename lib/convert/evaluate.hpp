// Evaluating a converter's lazy expressions on LibTorch: the moment tensor data is read.
#pragma once

#include <ATen/core/Tensor.h>

#include "convert/expr.hpp"
#include "storage/disk_map.hpp"
#include "storage/tensor_io.hpp"

namespace vramd::convert {

// The expression's value as a contiguous CPU tensor. Sources are read as zero-copy views of
// the file mapping, so only the pages an expression touches are read: a narrow() of a fused
// weight reads its slice and no more. Works the same each time it is called, so weights can
// be re-read from disk on every use. With ReadMode::Copy sources are read into fresh memory
// instead, so the result never points into the file.
at::Tensor evaluate(const Expr& expr, const storage::DiskMap& source, storage::ReadMode mode = storage::ReadMode::Auto);

}  // namespace vramd::convert
