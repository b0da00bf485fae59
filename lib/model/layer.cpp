#include "model/layer.hpp"

#include <ATen/TensorOperators.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rsqrt.h>

#include <functional>
#include <numeric>
#include <utility>

#include "model/progress.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {

namespace {
thread_local const std::atomic<bool>* t_cancel = nullptr;
}

CancelScope::CancelScope(const std::atomic<bool>* flag) : previous_(std::exchange(t_cancel, flag)) {}
CancelScope::~CancelScope() { t_cancel = previous_; }

const char* kind_name(LayerKind kind) {
  switch (kind) {
    case LayerKind::Linear: return "Linear";
    case LayerKind::Conv1D: return "Conv1D";
    case LayerKind::Embedding: return "Embedding";
    case LayerKind::LayerNorm: return "LayerNorm";
    case LayerKind::RMSNorm: return "RMSNorm";
    case LayerKind::Conv2d: return "Conv2d";
    case LayerKind::Tensors: return "Tensors";
  }
  return "?";
}

int64_t Parameter::elements() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

Layer::Layer(std::string path, LayerKind kind, std::vector<Parameter> parameters, LayerOptions options)
    : path_(std::move(path)), kind_(kind), parameters_(std::move(parameters)), options_(options) {}

Parameter& Layer::parameter(std::string_view short_name) {
  for (auto& parameter : parameters_)
    if (std::string_view(parameter.name).substr(path_.empty() ? 0 : path_.size() + 1) == short_name) return parameter;
  throw Error("layer " + quote(path_) + " has no parameter " + quote(short_name));
}

std::vector<at::Tensor> Layer::weights() const {
  std::vector<at::Tensor> values;
  values.reserve(parameters_.size());
  for (const auto& parameter : parameters_) {
    const at::Tensor& value = parameter.tied ? parameter.tied->value : parameter.value;
    if (value.is_meta()) throw Error("layer " + quote(path_) + ": parameter " + quote(parameter.name) + " was never loaded");
    values.push_back(value);
  }
  return values;
}

at::Tensor LoraTerms::fused(const std::vector<Term>& terms, const at::Tensor& value) {
  at::Tensor out = value.to(c10::kFloat, /*non_blocking=*/false, /*copy=*/true);
  for (const auto& term : terms) {
    at::Tensor delta = term.up.flatten(1).mm(term.down.flatten(1)).mul_(term.factor);
    if (term.transposed) delta = delta.t();
    out.add_(delta.reshape(out.sizes()));
  }
  return out;
}

// As peft computes an unfused adapter: the output plus up(down(x)) times the factor (an
// embedding's: the rows of down's transpose, then up). The output is the op's own, so each term
// is added in place by one addmm that scales it too: two ops a term, where the product, its
// scaling and the sum were four (four kernels on a GPU; on the CPU 47 us in place of 82 a term
// at 32 tokens of 1024, 312 in place of 431 at 512, same values).
at::Tensor Layer::with_lora(const at::Tensor& input, at::Tensor output) const {
  if (!output.is_contiguous()) output = output.contiguous();
  at::Tensor rows = output.view({-1, output.size(-1)});
  for (const auto& term : lora_->terms) {
    const at::Tensor down = kind_ == LayerKind::Embedding ? at::embedding(term.down.t(), input) : at::linear(input, term.down);
    if (term.up.scalar_type() == output.scalar_type())
      rows.addmm_(down.reshape({-1, down.size(-1)}), term.up.t(), 1, term.factor);
    else  // an output in another dtype than the factors: promoted, as the sum would
      rows = (output = output + at::linear(down, term.up) * term.factor).view({-1, output.size(-1)});
  }
  return output;
}

at::Tensor Layer::operator()(const at::Tensor& input) {
  if (t_cancel && t_cancel->load(std::memory_order_relaxed)) throw Cancelled("cancelled before " + quote(path_));
  at::Tensor output = op(input);
  return lora_ ? with_lora(input, std::move(output)) : output;
}

at::Tensor Layer::op(const at::Tensor& input) {
  if (!manager_) return apply(weights(), input);
  auto w = manager_->acquire(*this);
  try {
    // Weights a manager keeps on another device (experts computed on the CPU): the op runs
    // there, on the input carried across, and its output comes back.
    const bool elsewhere = !w.empty() && w[0].device() != input.device();
    at::Tensor output = elsewhere ? apply(w, input.to(w[0].device())).to(input.device()) : apply(w, input);
    w.clear();  // the weights go with the release, not later
    manager_->release(*this);
    return output;
  } catch (...) {
    manager_->release(*this);
    throw;
  }
}

at::Tensor Layer::apply(const std::vector<at::Tensor>& w, const at::Tensor& input) const {
  const at::Tensor bias = w.size() > 1 ? w[1] : at::Tensor();
  switch (kind_) {
    case LayerKind::Linear: return at::linear(input, w[0], bias);
    case LayerKind::Conv1D: {
      // GPT-2's Conv1D keeps its weight as [in, out].
      auto sizes = input.sizes().vec();
      sizes.back() = w[0].size(1);
      return at::addmm(bias, input.reshape({-1, input.size(-1)}), w[0]).view(sizes);
    }
    case LayerKind::Embedding: return at::embedding(w[0], input);
    case LayerKind::LayerNorm: return at::layer_norm(input, {w[0].size(0)}, w[0], bias, options_.eps);
    case LayerKind::RMSNorm: {
      // In float32, scaled back in the input's dtype (as LLaMA does).
      const at::Tensor x = input.to(at::kFloat);
      const at::Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, true) + options_.eps);
      if (options_.in_float) {
        const at::Tensor scale = options_.offset == 0 ? w[0].to(at::kFloat) : w[0].to(at::kFloat) + options_.offset;
        return (normed * scale).to(input.scalar_type());
      }
      return w[0] * normed.to(input.scalar_type());
    }
    case LayerKind::Conv2d:
      return at::conv2d(input, w[0], bias, {options_.stride, options_.stride}, {options_.padding, options_.padding});
    case LayerKind::Tensors: throw Error("layer " + quote(path_) + " holds tensors for leases and is never applied");
  }
  throw Error("unknown layer kind");
}

}  // namespace vramd::model
