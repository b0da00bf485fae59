// The hyperparameters of Meta's own checkpoints (consolidated.NN.pth beside params.json), under
// the names a config.json would give them, by the rules of transformers' LLaMA conversion: so
// that Meta's folder and its converter are a whole model config, with no [arch].
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "storage/disk_map.hpp"

namespace vramd::hparams {

// A config.json object (JSON text) of a LLaMA from params.json's object (read from `path`).
// vocab_size -1 (LLaMA 1 and 2, whose vocabulary is the tokenizer's) is counted from the rows
// of `map`'s output.weight. A key it lacks is left out, for [arch] to give. Throws Error naming the file and key for a key it does not read
// and for use_scaled_rope unless `rope_scaling_given` ([arch] sets rope_scaling): Meta's file
// does not say the factor, which differs between versions.
std::string meta_params_json(const nlohmann::json& params, const std::string& path, const storage::DiskMap& map,
                             bool rope_scaling_given);

}  // namespace vramd::hparams
