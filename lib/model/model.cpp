#include "model/model.hpp"

#include <ATen/ops/acos.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/asin.h>
#include <ATen/ops/atan.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/erf.h>
#include <ATen/ops/erfc.h>
#include <ATen/ops/erfinv.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/log.h>
#include <ATen/ops/log10.h>
#include <ATen/ops/log2.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/tan.h>
#include <ATen/ops/trunc.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {

Model::Model(std::string architecture, c10::ScalarType dtype, std::string base_prefix,
             std::vector<std::string> ignored_suffixes)
    : architecture_(std::move(architecture)),
      base_prefix_(std::move(base_prefix)),
      ignored_suffixes_(std::move(ignored_suffixes)),
      dtype_(dtype) {}


std::vector<Parameter*> Model::parameters() {
  std::vector<Parameter*> all;
  for (auto& layer : layers_)
    for (auto& parameter : layer->parameters()) all.push_back(&parameter);
  return all;
}

Parameter* Model::find(std::string_view name) {
  for (auto& layer : layers_)
    if (layer->path().empty() ||
        (name.starts_with(layer->path()) && name.size() > layer->path().size() && name[layer->path().size()] == '.'))
      for (auto& parameter : layer->parameters())
        if (parameter.name == name) return &parameter;
  return nullptr;
}

bool Model::ignores(std::string_view key) const {
  for (const auto& suffix : ignored_suffixes_)
    if (key.ends_with(suffix)) return true;
  return false;
}

Layer& Model::add(const std::string& path, LayerKind kind,
                  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes, LayerOptions options) {
  std::vector<Parameter> parameters;
  for (auto& [name, shape] : shapes) {
    at::Tensor meta = at::empty(shape, at::TensorOptions().device(c10::kMeta).dtype(dtype_));
    parameters.push_back(Parameter{path.empty() ? name : path + "." + name, std::move(shape), std::move(meta)});
  }
  layers_.push_back(std::make_unique<Layer>(path, kind, std::move(parameters), options));
  return *layers_.back();
}

Layer& Model::linear(const std::string& path, int64_t in, int64_t out, bool bias) {
  if (bias) return add(path, LayerKind::Linear, {{"weight", {out, in}}, {"bias", {out}}}, {});
  return add(path, LayerKind::Linear, {{"weight", {out, in}}}, {});
}

Layer& Model::conv1d(const std::string& path, int64_t in, int64_t out) {
  return add(path, LayerKind::Conv1D, {{"weight", {in, out}}, {"bias", {out}}}, {});
}

Layer& Model::embedding(const std::string& path, int64_t count, int64_t dim) {
  return add(path, LayerKind::Embedding, {{"weight", {count, dim}}}, {});
}

Layer& Model::layer_norm(const std::string& path, int64_t dim, double eps, bool bias) {
  if (bias) return add(path, LayerKind::LayerNorm, {{"weight", {dim}}, {"bias", {dim}}}, {.eps = eps});
  return add(path, LayerKind::LayerNorm, {{"weight", {dim}}}, {.eps = eps});
}

Layer& Model::tensors(const std::string& path, std::vector<std::pair<std::string, std::vector<int64_t>>> shapes) {
  return add(path, LayerKind::Tensors, std::move(shapes), {});
}

Layer& Model::rms_norm(const std::string& path, int64_t dim, double eps, double offset, bool in_float) {
  return add(path, LayerKind::RMSNorm, {{"weight", {dim}}}, {.eps = eps, .offset = offset, .in_float = in_float});
}

void Model::tie(Layer& follower, const Layer& leader) {
  Parameter& weight = follower.parameters()[0];
  const Parameter& source = leader.parameters()[0];
  if (weight.shape != source.shape)
    throw Error("cannot tie " + quote(weight.name) + " " + format_shape(weight.shape) + " to " + quote(source.name) +
                " " + format_shape(source.shape));
  weight.tied = &source;
}

// Inputs

Inputs::Inputs(const storage::NamedTensors& tensors, c10::Device device, std::span<const std::string> accepted)
    : tensors_(tensors), device_(device) {
  for (const auto& [name, tensor] : tensors_) {
    if (std::find(accepted.begin(), accepted.end(), name) != accepted.end()) continue;
    std::string all;
    for (const auto& candidate : accepted) all += (all.empty() ? "" : ", ") + candidate;
    const auto nearest = did_you_mean(name, {accepted.begin(), accepted.end()});
    throw Error("input " + quote(name) + " is not one this model takes" +
                (nearest ? "; did you mean " + quote(*nearest) + "?" : std::string()) + " (it takes " + all + ")");
  }
}

const at::Tensor* Inputs::find(std::string_view name) const {
  for (const auto& [key, tensor] : tensors_)
    if (key == name) return &tensor;
  return nullptr;
}

namespace {

std::string describe(const at::Tensor& tensor) {
  return storage::torch_name(tensor.scalar_type()) + " " + format_shape(tensor.sizes().vec());
}

// Ids of any integer dtype, as int64. A uint64 id past int64's range is refused as such.
at::Tensor checked_ids(std::string_view name, const at::Tensor& tensor, int64_t vocabulary) {
  if (!c10::isIntegralType(tensor.scalar_type(), false) || tensor.dim() != 2 || tensor.numel() == 0)
    throw Error("input " + quote(name) + ": expected integer token ids [batch, sequence], found " + describe(tensor));
  at::Tensor ids;
  if (tensor.scalar_type() == at::kUInt64) {
    ids = tensor.view(at::kLong);  // the same bits: ids of 2^63 and more read as negative
    if ((ids < 0).any().item<bool>())
      throw Error("input " + quote(name) + " holds an id of 2^63 or more, outside [0, " + std::to_string(vocabulary) + ")");
  } else {
    ids = tensor.to(at::kLong);
  }
  const int64_t low = ids.min().item<int64_t>(), high = ids.max().item<int64_t>();
  if (low < 0 || high >= vocabulary)
    throw Error("input " + quote(name) + " holds id " + std::to_string(low < 0 ? low : high) + ", outside [0, " +
                std::to_string(vocabulary) + ")");
  return ids;
}

}  // namespace

at::Tensor Inputs::token_ids(std::string_view name, int64_t vocabulary) const {
  const at::Tensor* tensor = find(name);
  if (!tensor) {
    std::string given;
    for (const auto& [key, value] : tensors_) given += (given.empty() ? "" : ", ") + quote(key);
    throw Error("missing input " + quote(name) + " (given: " + (given.empty() ? "none" : given) + ")");
  }
  return checked_ids(name, *tensor, vocabulary).to(device_);
}

std::optional<at::Tensor> Inputs::optional_ids(std::string_view name, const at::Tensor& like, int64_t vocabulary) const {
  const at::Tensor* tensor = find(name);
  if (!tensor) return std::nullopt;
  at::Tensor ids = checked_ids(name, *tensor, vocabulary);
  if (ids.sizes() != like.sizes())
    throw Error("input " + quote(name) + " is " + format_shape(ids.sizes().vec()) + " but input_ids is " +
                format_shape(like.sizes().vec()));
  return ids.to(device_);
}

void check_sequence_length(const at::Tensor& ids, int64_t limit, std::string_view key, std::string_view remedy) {
  if (ids.size(1) <= limit) return;
  throw Error("input 'input_ids' has " + std::to_string(ids.size(1)) + " tokens; this model takes at most " +
              std::to_string(limit) + " (" + std::string(key) + "; " + std::string(remedy) + ")");
}

at::Tensor Inputs::attention_mask(const at::Tensor& ids) const {
  const at::Tensor* mask = find("attention_mask");
  if (!mask) return at::ones(ids.sizes(), at::TensorOptions().dtype(at::kBool).device(device_));
  if (mask->sizes() != ids.sizes())
    throw Error("input 'attention_mask' is " + format_shape(mask->sizes().vec()) + " but input_ids is " +
                format_shape(ids.sizes().vec()));
  if (!((*mask == 0) | (*mask == 1)).all().item<bool>())
    throw Error("input 'attention_mask' must hold only 0 and 1, found " + describe(*mask) + " with other values");
  return mask->to(device_).to(at::kBool);
}

bool Inputs::flag(std::string_view name) const {
  const at::Tensor* tensor = find(name);
  if (!tensor) return false;
  if (tensor->numel() != 1 || tensor->is_complex() || !(tensor->eq(0).item<bool>() || tensor->eq(1).item<bool>()))
    throw Error("input " + quote(name) + " must be one element, 0 or 1, found " + describe(*tensor) +
                (tensor->numel() == 1 && !tensor->is_complex() ? " holding " + std::to_string(tensor->item<double>()) : ""));
  return tensor->eq(1).item<bool>();
}

// Masks and attention

namespace {

// 0 where allowed, the dtype's lowest value elsewhere.
at::Tensor additive(const at::Tensor& allowed, c10::ScalarType dtype) {
  double lowest = std::numeric_limits<float>::lowest();
  if (dtype == at::kBFloat16) lowest = static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest());
  if (dtype == at::kHalf) lowest = static_cast<float>(std::numeric_limits<c10::Half>::lowest());
  const auto options = allowed.options().dtype(dtype);
  return at::where(allowed, at::zeros({}, options), at::full({}, lowest, options));
}

}  // namespace

at::Tensor padding_mask(const at::Tensor& keep, c10::ScalarType dtype) {
  return additive(keep.view({keep.size(0), 1, 1, keep.size(1)}), dtype);
}

at::Tensor causal_mask(const at::Tensor& keep, c10::ScalarType dtype, int64_t window) {
  const int64_t length = keep.size(1);
  const at::Tensor position = at::arange(length, keep.options().dtype(at::kLong));
  const at::Tensor query = position.view({length, 1}), key = position.view({1, length});
  at::Tensor allowed = key <= query;
  if (window > 0) allowed = allowed & (query - key < window);
  return additive(allowed.view({1, 1, length, length}) & keep.view({keep.size(0), 1, 1, length}), dtype);
}

at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                     double scale) {
  const bool grouped = key.size(1) != query.size(1);
  return at::scaled_dot_product_attention(query, key, value, mask, 0.0, false, scale, grouped);
}

// Activations

namespace {

at::Tensor gelu(const at::Tensor& x) { return at::gelu(x); }
at::Tensor gelu_tanh(const at::Tensor& x) { return at::gelu(x, "tanh"); }
// GPT-2's "gelu_new", written out as GPT-2 defines it.
at::Tensor gelu_new(const at::Tensor& x) {
  return 0.5 * x * (1.0 + at::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3.0))));
}
at::Tensor silu(const at::Tensor& x) { return at::silu(x); }
// CLIP's "quick_gelu".
at::Tensor quick_gelu(const at::Tensor& x) { return x * at::sigmoid(1.702 * x); }
at::Tensor relu(const at::Tensor& x) { return at::relu(x); }

}  // namespace

void settle_vector_math() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::InferenceMode inference;
    // The functions ATen hands to MKL's VML (ATen/cpu/vml.h), in both of its types, on fewer
    // elements than a parallel loop splits: computed here, on this thread alone.
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      const at::Tensor x = at::full({16}, 0.5, at::TensorOptions().dtype(dtype));
      using Unary = at::Tensor (*)(const at::Tensor&);
      for (const Unary op : {at::acos, at::asin, at::atan, at::cos, at::erf, at::erfc, at::erfinv, at::exp, at::log,
                             at::log10, at::log2, at::sin, at::sqrt, at::tan, at::tanh, at::trunc})
        op(x);
    }
  });
}

Activation activation(const std::string& name, const std::string& origin) {
  if (name == "gelu") return gelu;
  if (name == "gelu_new") return gelu_new;
  if (name == "gelu_pytorch_tanh") return gelu_tanh;
  if (name == "silu" || name == "swish") return silu;
  if (name == "relu") return relu;
  if (name == "quick_gelu") return quick_gelu;
  fail(origin, "activation " + quote(name) + " is not supported (gelu, gelu_new, gelu_pytorch_tanh, quick_gelu, silu, swish, relu)");
}

}  // namespace vramd::model
