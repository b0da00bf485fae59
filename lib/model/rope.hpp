// Rotary position embeddings as transformers computes them: the inverse frequencies of each
// rope type (default, linear, dynamic, llama3, yarn, longrope) and the cos/sin tables of one
// forward. A switch the code cannot honour never reaches here: family/blueprint.cpp refuses it.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>

#include "family/blueprint.hpp"

namespace vramd::model {

class RotaryEmbedding {
 public:
  // `rotary_dims`: how many of each head's dimensions rotate (head_dim times the partial factor);
  // `max_positions`: the model's max_position_embeddings (dynamic and longrope read it).
  RotaryEmbedding(const family::Rope& rope, int64_t rotary_dims, int64_t max_positions);

  // cos and sin [batch, 1, sequence, rotary_dims] in `dtype` for `positions` [batch, sequence].
  std::pair<at::Tensor, at::Tensor> tables(const at::Tensor& positions, c10::ScalarType dtype) const;

  // x [batch, heads, sequence, head_dim] rotated by the tables (its first rotary_dims dimensions).
  static at::Tensor apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

 private:
  at::Tensor inv_freq(int64_t sequence) const;

  family::Rope rope_;
  int64_t dims_, max_positions_;
  at::Tensor inv_freq_;     // float32, for sequences within the original context
  at::Tensor long_freq_;    // longrope: beyond it
  double scaling_ = 1.0;    // attention scaling of cos and sin (yarn, longrope)
};

}  // namespace vramd::model
