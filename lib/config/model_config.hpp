// One model's config file (configs/models/NAME.toml). Schema: docs/config.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "config/daemon_config.hpp"
#include "storage/disk_map.hpp"
#include "storage/dtype.hpp"

namespace vramd::config {

// A dtype a config names: float32, bfloat16, float16, float8_e4m3fn or float8_e5m2 (the
// model's and the resting states'; computation only the first three). nullopt: "auto", the
// checkpoint's own, settled when the model loads.
using Dtype = std::optional<storage::DType>;
std::string dtype_str(const Dtype& dtype);  // LibTorch's spelling, or "auto"

// Where a layer's weights are in one of its four states, and in which dtype.
struct DeviceState {
  Device device;
  Dtype dtype;
  // GGUF block-quantized weights held as their packed bytes (the rest in `dtype`): true, false,
  // or unset ("auto": packed when the model streams under [vram].limit). Never in computation;
  // meaningless on disk, where weights are the checkpoint's own bytes.
  std::optional<bool> packed = std::nullopt;
};

struct VramConfig {
  DeviceState offload, onload, preparing, computation;
  std::optional<uint64_t> limit;  // bytes of weights on the computation device
  // Bytes of streamed weights resting on the onload device: the first streamed layers that fit
  // rest there, the rest on disk (GPUs first, then host, then disk, as a device map places them).
  std::optional<uint64_t> onload_limit;
  // Weights read from the checkpoint after loading bypass the page cache (O_DIRECT): for a
  // checkpoint streamed from disk that the page cache cannot keep. Unset ("auto"): chosen at
  // load from the checkpoint's size and the memory the page cache can have.
  std::optional<bool> direct_io;
  // Every expert of a mixture computed on the CPU from host memory, in the computation dtype,
  // while the rest computes on the GPU (llama.cpp's --cpu-moe): `experts = "cpu"`.
  bool experts_on_cpu = false;
};

struct ResidencyConfig {
  std::optional<std::chrono::milliseconds> keep_alive;  // nullopt: forever
  bool pinned = false;
  bool preload = false;
};

// Partitioned loading across the daemon's group of processes (docs/config.md "[partition]"):
// each rank holds 1/world_size of every parameter and gathers a layer only while it runs.
struct PartitionConfig {
  int world_size = 1;                  // 1: not partitioned
  std::vector<std::string> replicate;  // globs over parameter names held whole on every rank
  std::chrono::milliseconds timeout{60'000};  // for every rank to join, load or answer a gather
};

// A LoRA adapter ([[lora]]): a PEFT folder or a .safetensors file (load/lora.hpp), and the
// scale its update is multiplied by.
struct LoraConfig {
  std::string path;  // absolute
  double scale = 1.0;
  bool operator==(const LoraConfig&) const = default;
};

// converter = "transformers": transformers' own load-time conversion for the model type of
// config.json (a GGUF file's metadata), written as a converter by the daemon's Python
// (load/conversion.hpp).
inline constexpr const char* kTransformersConverter = "transformers";

struct ModelConfig {
  std::string path;  // the file read
  std::string name;
  // A family's name, the absolute path of a family file, "weights", or empty: the family that
  // declares the checkpoint's model_type (family/catalog.hpp).
  std::string architecture;
  std::vector<std::string> architecture_folders;  // the daemon's, for families by name
  std::vector<std::string> checkpoint;  // absolute paths or globs
  std::string prefix;
  bool keep_prefix = false;
  std::string converter;  // absolute path of the Lua script, kTransformersConverter, or empty
  // Under kTransformersConverter for a GGUF file: the absolute path of gguf.lua, which makes its
  // names Hugging Face's for transformers' rules to read (run first, convert/chain.hpp); else empty.
  std::string converter_first;
  std::string python;     // the daemon's (DaemonConfig::python), for kTransformersConverter
  Dtype dtype;            // the weights' dtype once loaded
  bool strict = true;     // missing or unexpected keys fail the load
  VramConfig vram;
  ResidencyConfig residency;
  PartitionConfig partition;
  std::vector<LoraConfig> lora;  // applied in order, their updates summed
  bool fuse_lora = true;         // added to the weights (true) or computed beside them at each op
  std::string arch_json;  // the [arch] overrides as a JSON object ("{}" when none)
  // Where each key stands in the file, by its dotted path ("vram.limit", "vram.onload.device"):
  // {line, column}, for the problems found once the file is read (a plan, a budget): where().
  std::map<std::string, std::pair<uint32_t, uint32_t>> positions;
};

// "<path>:<line>:<column>" of `key` (a dotted path) in the config's file; of the nearest table
// above it that the file has ("vram" for "vram.limit" left out); else the file's path alone.
std::string where(const ModelConfig& config, std::string_view key);

// A model of architecture "weights" with a [vram] table that streams (a limit, a state in a
// dtype other than the computation's, or GGUF blocks kept packed): the daemon computes nothing
// with it, so its weights rest in host memory, in the onload state's dtype (GGUF blocks packed
// where it keeps them so), for the clients that lease and manage it
// (python/vramd/manage/), each streaming them through its own device under the limit.
bool rests_for_clients(const ModelConfig& config);

// A "weights" model with fuse_lora = false: the daemon checks its adapters and keeps its weights
// the checkpoint's; the clients that manage it add the adapters as they prepare each unit
// (python/vramd/manage/lora.py), from the list a lease's manifest carries (`loras`).
bool clients_apply_adapters(const ModelConfig& config);

// Relative paths are resolved against the file's folder (a converter also against the daemon's
// converter folders). Throws Error listing every problem, each with file, line and column.
ModelConfig load_model_config(const std::string& path, const DaemonConfig& daemon);
// The same, from the file's bytes as read once (the daemon compares them with what it serves).
ModelConfig load_model_config(const std::string& path, const std::string& text, const DaemonConfig& daemon);

// The model's checkpoint as its config reads it: under its prefix, and with a converter, the
// same name in several files as slices for the converter to join (DiskMapOptions::shards).
// Inline, so that reading a config links no checkpoint reader (fuzz/fuzz_model_config).
inline storage::DiskMap open_checkpoint(const ModelConfig& config) {
  return storage::DiskMap::open(config.checkpoint,
                                {.prefix = config.prefix, .strip_prefix = !config.keep_prefix, .shards = !config.converter.empty()});
}

}  // namespace vramd::config
