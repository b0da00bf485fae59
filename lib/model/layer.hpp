// The one abstraction every weight-holding leaf layer goes through (Linear, GPT-2's Conv1D,
// Embedding, LayerNorm, RMSNorm, Conv2d). A Layer owns its parameters and is the only place an
// op fetches its weights (Layer::weights), so VRAM management decides where weights live and
// when they move in one place, without touching the architectures.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace vramd::model {

class Layer;

// Where a layer's weights come from for the duration of one op: its model's weights
// (weights/weights.hpp), which may bring them in for the op and take them away after it.
class LayerWeights {
 public:
  virtual ~LayerWeights() = default;
  // The layer's weights on the computation device, in the computation dtype, until release().
  virtual std::vector<at::Tensor> acquire(const Layer& layer) = 0;
  virtual void release(const Layer& layer) = 0;
  // These layers' ops run next, in this order (the experts a batch was routed to), in place of
  // any expected before: a manager may bring their weights in ahead of them.
  virtual void expect(std::span<const Layer* const>) {}
};

// Stops a forward between ops: while one is alive on a thread, each layer op on that thread
// first looks at `flag` and throws model::Cancelled (model/progress.hpp) once it is set. Ops
// already running finish; what the weights' manager has in flight (streamed reads) is its own.
class CancelScope {
 public:
  explicit CancelScope(const std::atomic<bool>* flag);
  ~CancelScope();
  CancelScope(const CancelScope&) = delete;
  CancelScope& operator=(const CancelScope&) = delete;

 private:
  const std::atomic<bool>* previous_;
};

// Tensors: parameters held for leases alone, never applied (the "weights" architecture).
enum class LayerKind { Linear, Conv1D, Embedding, LayerNorm, RMSNorm, Conv2d, Tensors };
const char* kind_name(LayerKind kind);

// What LoRA adapters add to one weight (load/lora.hpp): the sum of factor * up * down. Fused, it
// is added to the weight wherever the weight is read from its checkpoint (weights::Source::read);
// unfused, the layer adds factor * (x A^T) B^T to its op's output at each call (Layer::set_lora).
struct LoraTerms {
  struct Term {
    at::Tensor down, up;  // [r, in(, kh, kw)] and [out, r(, 1, 1)]: float32 on the CPU, or unfused on the
                          // computation device in the computation dtype
    double factor = 1;    // the adapter's scale times alpha / r (alpha / sqrt(r) for rsLoRA)
    bool transposed = false;  // the weight is [in, out] (an embedding's, GPT-2's Conv1D): the update transposed
  };
  std::vector<Term> terms;
  // Terms on a checkpoint tensor the weight's expression reads, where the adapter names the
  // checkpoint's module and a converter stacks or joins it into this weight (a Mixtral's
  // experts.0.w1 into experts.gate_up_proj): fused into that tensor as it is read, before the
  // expression, so the weight is the conversion of the adapted tensors.
  struct OnSource {
    std::string key;  // the checkpoint's tensor, "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    std::vector<Term> terms;
  };
  std::vector<OnSource> sources;
  // `value` (the weight in any floating dtype, on the CPU) plus every term, a new float32 tensor,
  // in peft's order: each product times its factor, then added.
  at::Tensor fused(const at::Tensor& value) const { return fused(terms, value); }
  static at::Tensor fused(const std::vector<Term>& terms, const at::Tensor& value);
};

struct Parameter {
  std::string name;  // the canonical (Hugging Face) name, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<int64_t> shape;
  at::Tensor value;              // on the meta device until loaded
  const Parameter* tied = nullptr;  // when set, shares that parameter's storage and is not loaded itself

  int64_t elements() const;
};

struct LayerOptions {
  double eps = 1e-5;        // LayerNorm, RMSNorm
  // RMSNorm: LLaMA's scales the normalised input, cast back to its dtype, by the weight; with
  // `in_float` the weight plus `offset` scales it in float32 before the cast (Gemma's 1 + w,
  // OLMo 2's w).
  double offset = 0;
  bool in_float = false;
  int64_t stride = 1;       // Conv2d
  int64_t padding = 0;      // Conv2d
};

class Layer {
 public:
  Layer(std::string path, LayerKind kind, std::vector<Parameter> parameters, LayerOptions options);
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const std::string& path() const { return path_; }  // "model.layers.0.mlp.up_proj"
  LayerKind kind() const { return kind_; }
  std::span<Parameter> parameters() { return parameters_; }
  std::span<const Parameter> parameters() const { return parameters_; }
  Parameter& parameter(std::string_view short_name);  // "weight", "bias"

  // Linear, Conv1D: x -> x W^T + b (Conv1D: x W + b); Embedding: ids -> rows; norms: normalised x;
  // Conv2d: NCHW convolution.
  at::Tensor operator()(const at::Tensor& input);

  // LoRA terms computed beside the weight at each op (unfused adapters; Linear and Embedding
  // only), or none. Replaced between forwards.
  void set_lora(std::shared_ptr<const LoraTerms> terms) { lora_ = std::move(terms); }
  const std::shared_ptr<const LoraTerms>& lora() const { return lora_; }

  // With a manager, weights come from it for the op's duration.
  void set_manager(LayerWeights* manager) { manager_ = manager; }
  // Tells their manager (one model's layers share one) that these layers' ops run next.
  static void expect(std::span<const Layer* const> layers) {
    if (!layers.empty() && layers.front()->manager_) layers.front()->manager_->expect(layers);
  }
  // A routed layer (a projection of one expert of a mixture) runs only for the tokens routed to
  // it, so no forward's order says when it runs next: managers bring it in only when expected.
  bool routed() const { return routed_; }
  void mark_routed() { routed_ = true; }

  // The values its parameters hold (a tied one's: its leader's): what the op uses without a
  // manager. Throws Error naming a parameter that was never loaded.
  std::vector<at::Tensor> weights() const;

 private:
  at::Tensor op(const at::Tensor& input);  // the op on its weights, wherever they come from
  at::Tensor apply(const std::vector<at::Tensor>& w, const at::Tensor& input) const;
  at::Tensor with_lora(const at::Tensor& input, at::Tensor output) const;

  std::string path_;
  LayerKind kind_;
  std::vector<Parameter> parameters_;
  LayerOptions options_;
  LayerWeights* manager_ = nullptr;
  bool routed_ = false;
  std::shared_ptr<const LoraTerms> lora_;
};

}  // namespace vramd::model
