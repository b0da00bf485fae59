// A model: its weight-holding layers (model/layer.hpp), built on the meta device by an
// architecture (model/registry.hpp), filled by the loader (load/loader.hpp), run by forward().
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/layer.hpp"
#include "storage/tensor_io.hpp"

namespace vramd::model {

class Model {
 public:
  virtual ~Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Named inputs to named outputs. Throws Error naming the input that is missing or wrong.
  virtual storage::NamedTensors forward(const storage::NamedTensors& inputs) = 0;

  const std::string& architecture() const { return architecture_; }
  c10::ScalarType dtype() const { return dtype_; }  // of weights and activations
  c10::Device device() const { return device_; }
  void set_device(c10::Device device) { device_ = device; }  // where the loader put the weights

  std::span<const std::unique_ptr<Layer>> layers() const { return layers_; }
  std::vector<Parameter*> parameters();  // in the order the layers were made
  Parameter* find(std::string_view name);

  // The prefix of the base model's names inside a model with a head ("model." for LLaMA's
  // causal LM): a checkpoint of the bare base model lacks it, one with a head has it.
  const std::string& base_prefix() const { return base_prefix_; }
  // Whether a checkpoint key is a buffer this architecture does not load (e.g. GPT-2's attn.bias).
  bool ignores(std::string_view key) const;

 protected:
  Model(std::string architecture, c10::ScalarType dtype, std::string base_prefix,
        std::vector<std::string> ignored_suffixes);

  Layer& linear(const std::string& path, int64_t in, int64_t out, bool bias);
  Layer& conv1d(const std::string& path, int64_t in, int64_t out);  // GPT-2's transposed Linear
  Layer& embedding(const std::string& path, int64_t count, int64_t dim);
  Layer& layer_norm(const std::string& path, int64_t dim, double eps, bool bias = true);
  Layer& rms_norm(const std::string& path, int64_t dim, double eps, double offset = 0, bool in_float = false);
  // Parameters held and never applied (LayerKind::Tensors), named `path`.`name` (`name` when
  // `path` is empty).
  Layer& tensors(const std::string& path, std::vector<std::pair<std::string, std::vector<int64_t>>> shapes);
  // `follower`'s weight is `leader`'s: one storage, loaded once.
  static void tie(Layer& follower, const Layer& leader);

 private:
  Layer& add(const std::string& path, LayerKind kind, std::vector<std::pair<std::string, std::vector<int64_t>>> shapes,
             LayerOptions options);

  std::string architecture_;
  std::string base_prefix_;
  std::vector<std::string> ignored_suffixes_;
  c10::ScalarType dtype_;
  c10::Device device_ = c10::kCPU;
  std::vector<std::unique_ptr<Layer>> layers_;
};

// The inputs of one forward, checked as they are read: errors name the input and say what was
// expected and found.
class Inputs {
 public:
  // Throws Error for a tensor whose name is not in `accepted` (the names the model's forward
  // reads), naming it, the nearest accepted name and all of them: an input that would be
  // ignored is refused, never dropped.
  Inputs(const storage::NamedTensors& tensors, c10::Device device, std::span<const std::string> accepted);
  // [batch, sequence] token ids below `vocabulary`, as int64 on the model's device.
  at::Tensor token_ids(std::string_view name, int64_t vocabulary) const;
  // The same shape as `like`; absent: nullopt.
  std::optional<at::Tensor> optional_ids(std::string_view name, const at::Tensor& like, int64_t vocabulary) const;
  // [batch, sequence] of 0/1 (any dtype), as bool; absent: all ones.
  at::Tensor attention_mask(const at::Tensor& ids) const;
  // A switch given as one element of 0 or 1 (any dtype, any shape of one element); absent: false.
  bool flag(std::string_view name) const;

 private:
  const at::Tensor* find(std::string_view name) const;
  const storage::NamedTensors& tensors_;
  c10::Device device_;
};

// Refuses input_ids longer than `limit` tokens, naming the hyperparameter `key` it comes from
// and, in `remedy`, what would raise it.
void check_sequence_length(const at::Tensor& ids, int64_t limit, std::string_view key, std::string_view remedy);

// Additive attention masks [batch, 1, query, key] in `dtype`: 0 where attention is allowed, the
// dtype's lowest value where not. `window` > 0 keeps only the last `window` keys (sliding window).
at::Tensor causal_mask(const at::Tensor& keep, c10::ScalarType dtype, int64_t window = 0);
at::Tensor padding_mask(const at::Tensor& keep, c10::ScalarType dtype);

// Softmax attention over [batch, heads, sequence, head_dim]; key/value may have fewer heads
// (grouped-query attention).
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                     double scale);

// Calls once per process, on this thread, each of LibTorch's CPU math functions that Intel MKL's
// vector math (VML) computes, on 16 elements. Where two threads of a forward called one of them
// for the first time at once, one thread's share of the rows sometimes came out in other bits
// (docs/benchmarks.md, "Numerics against transformers"). load_model() calls it before any model
// computes.
void settle_vector_math();

// Hugging Face activation names: "gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu", "silu", "swish", "relu".
using Activation = at::Tensor (*)(const at::Tensor&);
Activation activation(const std::string& name, const std::string& origin);

}  // namespace vramd::model
