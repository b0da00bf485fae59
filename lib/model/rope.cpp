#include "model/rope.hpp"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>

#include <cmath>
#include <numbers>

namespace vramd::model {
namespace {

at::Tensor float_tensor(const std::vector<double>& values) {
  std::vector<float> floats(values.begin(), values.end());
  return at::tensor(floats, at::TensorOptions().dtype(at::kFloat));
}

// base^(2i / dim) for i < dim / 2, float32, as transformers computes it.
at::Tensor position_frequencies(double base, int64_t dim) {
  const at::Tensor exponents = at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / dim;
  return at::pow(base, exponents);
}

double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// YaRN: interpolated frequencies blended with extrapolated ones along a ramp over the dimensions.
at::Tensor yarn(const family::Rope& rope, int64_t dim, double& scaling) {
  const double base = rope.theta, factor = rope.factor;
  const auto original = static_cast<double>(rope.original_max_positions);
  if (rope.attention_factor) scaling = *rope.attention_factor;
  else if (rope.mscale.value_or(0) != 0 && rope.mscale_all_dim.value_or(0) != 0)
    scaling = yarn_mscale(factor, *rope.mscale) / yarn_mscale(factor, *rope.mscale_all_dim);
  else scaling = yarn_mscale(factor, 1);
  const auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) * std::log(original / (rotations * 2 * std::numbers::pi))) / (2 * std::log(base));
  };
  double low = correction_dim(rope.beta_fast), high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const at::Tensor ramp = at::clamp((at::arange(dim / 2, at::TensorOptions().dtype(at::kFloat)) - low) / (high - low), 0, 1);
  const at::Tensor extrapolation_factor = 1 - ramp;
  const at::Tensor frequencies = position_frequencies(base, dim);
  const at::Tensor extrapolation = 1.0 / frequencies;
  const at::Tensor interpolation = 1.0 / (factor * frequencies);
  return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
}

at::Tensor llama3(const family::Rope& rope, const at::Tensor& inv_freq) {
  const double factor = rope.factor, low = rope.low_freq_factor, high = rope.high_freq_factor;
  const auto context = static_cast<double>(rope.original_max_positions);
  const double low_wavelen = context / low, high_wavelen = context / high;
  const at::Tensor wavelen = 2 * std::numbers::pi / inv_freq;
  const at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / factor, inv_freq);
  const at::Tensor smooth = (context / wavelen - low) / (high - low);
  const at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
  const at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

}  // namespace

RotaryEmbedding::RotaryEmbedding(const family::Rope& rope, int64_t rotary_dims, int64_t max_positions)
    : rope_(rope), dims_(rotary_dims), max_positions_(max_positions) {
  const at::Tensor plain = 1.0 / position_frequencies(rope.theta, dims_);
  if (rope.type == "default") inv_freq_ = plain;
  else if (rope.type == "linear") inv_freq_ = plain / rope.factor;
  else if (rope.type == "llama3") inv_freq_ = llama3(rope, plain);
  else if (rope.type == "yarn") inv_freq_ = yarn(rope, dims_, scaling_);
  else if (rope.type == "longrope") {
    // Short factors up to the original context, long ones beyond it; the scaling from the
    // ratio of the contexts unless given.
    const double factor = rope.factor_given ? rope.factor
                                            : static_cast<double>(max_positions_) / static_cast<double>(rope.original_max_positions);
    scaling_ = rope.attention_factor ? *rope.attention_factor
               : factor <= 1.0       ? 1.0
                                     : std::sqrt(1 + std::log(factor) / std::log(static_cast<double>(rope.original_max_positions)));
    const at::Tensor frequencies = position_frequencies(rope.theta, dims_);
    inv_freq_ = 1.0 / (float_tensor(rope.short_factor) * frequencies);
    long_freq_ = 1.0 / (float_tensor(rope.long_factor) * frequencies);
  }
}

at::Tensor RotaryEmbedding::inv_freq(int64_t sequence) const {
  if (long_freq_.defined() && sequence > rope_.original_max_positions) return long_freq_;
  return inv_freq_;
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::tables(const at::Tensor& positions, c10::ScalarType dtype) const {
  const int64_t sequence = long_freq_.defined() ? positions.max().item<int64_t>() + 1 : 0;
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq(sequence).to(positions.device()).view({1, 1, -1});
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {(angles.cos() * scaling_).to(dtype).unsqueeze(1), (angles.sin() * scaling_).to(dtype).unsqueeze(1)};
}

at::Tensor RotaryEmbedding::apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t dims = cos.size(-1), half = dims / 2;
  const at::Tensor rotating = dims == x.size(-1) ? x : x.narrow(-1, 0, dims);
  const at::Tensor rotated = at::cat({-rotating.narrow(-1, half, half), rotating.narrow(-1, 0, half)}, -1);
  const at::Tensor out = rotating * cos + rotated * sin;
  return dims == x.size(-1) ? out : at::cat({out, x.narrow(-1, dims, x.size(-1) - dims)}, -1);
}

}  // namespace vramd::model
