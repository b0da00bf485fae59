// The converter a model config names, run over its checkpoint's index: none, a Lua script
// (scripts/converters/README.md), or converter = "transformers": transformers' own load-time
// conversion for the model type of config.json (transformers.conversion_mapping: renames,
// experts stored one tensor each merged into one), which the daemon's Python writes as a Lua
// converter for this checkpoint's names (python -m vramd.transformers_converter --stdin); for a
// GGUF file, for the Hugging Face names gguf.lua makes of llama.cpp's.
#pragma once

#include <string>

#include "config/model_config.hpp"
#include "convert/converter.hpp"
#include "hparams/hyperparams.hpp"
#include "storage/disk_map.hpp"

namespace vramd::load {

// The target names and their expressions. Throws Error naming the script, or for
// "transformers" the config's converter key and what the Python said.
convert::ConversionPlan conversion_plan(const config::ModelConfig& config, const storage::DiskMap& map,
                                        const hparams::Hyperparams& hyperparams);
// The same, with the hyperparameters read from `map` only where a converter needs them (a
// checkpoint without a config.json or known metadata converts under converter = "").
convert::ConversionPlan conversion_plan(const config::ModelConfig& config, const storage::DiskMap& map);

// The Lua text "transformers" stands for, over `map`'s names (a GGUF file's: over those gguf.lua
// makes of them, gguf.lua chained before it): written by config.python once per process for the
// same names, hyperparameters and Python (a later call reads it from memory).
std::string transformers_converter(const config::ModelConfig& config, const storage::DiskMap& map,
                                   const hparams::Hyperparams& hyperparams);

}  // namespace vramd::load
