// The hyperparameters of a GGUF checkpoint, from its metadata, under the names a config.json
// beside a safetensors checkpoint would give them (Hugging Face's), so that one line,
// checkpoint = "model.gguf", is a whole model config.
#pragma once

#include <string>

#include "storage/disk_map.hpp"

namespace vramd::hparams {

// A config.json object (JSON text) for the GGUF file `map` holds first. Throws Error naming the
// file and key for an architecture vramd does not run from GGUF, and for any key of that
// architecture it does not read: one it cannot honour would compute another model.
std::string gguf_config_json(const storage::DiskMap& map);

}  // namespace vramd::hparams
