// LoRA adapters ([[lora]] in a model config): each read and checked whole, then its update of
// each weight attached to that weight's assignment (weights::Patch), which every kind of weights
// applies where it reads the weight from the checkpoint: W + scale * alpha / r * B * A, in float32,
// then held in each state's dtype. The adapted values are what the model holds in every state,
// and what a lease hands over; the checkpoint itself is never changed.
//
// An adapter is a PEFT folder (adapter_config.json beside adapter_model.safetensors or .bin, whose
// r, lora_alpha, use_rslora, rank_pattern, alpha_pattern and target_modules are honoured), or
// one .safetensors (or torch.save) file whose keys are
//   PEFT's or diffusers'  <module>.lora_A.weight and .lora_B.weight (an optional <module>.alpha;
//                         none: alpha = r), or <module>.lora.down.weight and .lora.up.weight
//   kohya's (A1111)       lora_unet_<module, dots as underscores>.lora_down.weight, .lora_up.weight
//                         and .alpha (lora_te_... for a text encoder)
// Module names are the checkpoint's once converted (a model's converter maps its adapter's names
// as it maps the checkpoint's: the adapter names the modules the converter makes); a leading
// base_model.model., unet., transformer. or text_encoder. is taken off where the rest names a
// module. A file for several models (a UNet's and its text encoder's keys) changes the modules
// of this one: a component none of whose modules are this model's is skipped, with a warning.
// A module that is none of the model's but a checkpoint tensor a converter joins into weights
// (experts.N.w1 stacked into experts.gate_up_proj) takes its terms there, before the expression
// (model::LoraTerms::sources): fused only.
// Linear, Conv2d (LoCon) and Embedding updates; DoRA, LoHa, LoKr, bias and full-difference keys
// and other PEFT types are refused naming the format.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "load/names.hpp"
#include "load/update.hpp"
#include "model/load_report.hpp"
#include "model/model.hpp"
#include "util/error.hpp"
#include "weights/loaded_model.hpp"
#include "weights/source.hpp"

namespace vramd::load {

// An adapter that cannot be applied: the message names the config, the adapter's file and its
// key. The load fails with it, and the model's other state is untouched.
class BadAdapter : public Error {
 public:
  using Error::Error;
};

// A set of adapters read and checked whole: each weight's terms, and what each adapter changes.
struct LoraSet {
  std::map<const model::Parameter*, std::shared_ptr<const weights::Patch>> patches;
  std::vector<model::AdapterReport> adapters;
  std::vector<std::string> warnings;  // components of a file skipped
};

// Where a model's adapters are added: to its weights as they are read (fuse_lora = true); beside
// each layer's op (fuse_lora = false), which only linear and embedding layers compute; or, for a
// "weights" model with fuse_lora = false, by the clients that manage it (config::
// clients_apply_adapters), the daemon only checking them and holding none.
enum class Applied { Fused, Unfused, ByClients };
Applied applied(const config::ModelConfig& config);

// Reads `loras` for `model`, whose weights `assignments` fill, to be applied as `applied` says;
// `where_of(i)` names the i-th in messages. Throws BadAdapter naming it and the key.
LoraSet read_loras(const std::vector<config::LoraConfig>& loras, model::Model& model,
                   const std::vector<weights::Assignment>& assignments, Applied applied,
                   const std::function<std::string(size_t)>& where_of);

// Reads every adapter of config.lora and attaches each weight's terms to its assignment, in
// config order (fuse_lora = false: to the layer that computes them, on the CPU until
// place_loras; applied by clients: to nothing); report.adapters says what each changes. Throws
// BadAdapter.
void attach_loras(const config::ModelConfig& config, model::Model& model, std::vector<weights::Assignment>& assignments,
                  model::LoadReport& report);

// The terms of layers that compute them unfused, moved to the model's device and dtype once its
// weights are loaded.
void place_loras(model::Model& model);

// Replaces a loaded model's adapters with `loras` ([] removes them all) without a reload: the
// new set read and checked whole, then every weight either set changes takes its value anew (the
// checkpoint's plus the new terms, or the checkpoint's alone) as one update (weights::Weights::
// update: the version goes up, a forward runs wholly on one set); unfused, each layer's terms are
// replaced and no weight is written; applied by clients, nothing changes here but the set in
// force, which the leases' next manifests list. A weight read from the checkpoint at each use
// (a layer streamed from disk) is not written either: its next read applies the new set.
// Returns the new set's adapters; `report` counts the weights either set changes and the bytes
// written.
// Throws BadUpdate (a bad adapter: nothing changed), weights::NotUpdatable (weights that cannot
// take an update: packed blocks) and weights::UpdateNeedsRoom, each with the adapters in force
// kept.
std::vector<model::AdapterReport> switch_loras(weights::LoadedModel& loaded, const config::ModelConfig& config,
                                               const std::vector<config::LoraConfig>& loras, const UpdateSpace& space,
                                               UpdateReport& report);

}  // namespace vramd::load
