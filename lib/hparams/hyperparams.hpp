// A model's hyperparameters: the config.json beside its checkpoint (Hugging Face field names),
// what a sentence-transformers folder says about pooling, and the model config's [arch] table
// over both. Architectures read them through typed getters whose errors say where to fix them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace vramd::config {
struct ModelConfig;
}
namespace vramd::storage {
class DiskMap;
}

namespace vramd::hparams {

class Hyperparams {
 public:
  // `json`: an object; `origin`: where it came from, for messages.
  Hyperparams(const std::string& json, std::string origin);

  // config.json in `folder` (when present), sentence-transformers' modules.json there (sets
  // "pooling" and "normalize"), then `overrides_json` (the [arch] table) merged over them.
  // A checkpoint that carries its own (a GGUF file: hparams/gguf_config.hpp) gives it as
  // `own_json`, from `own_origin`, which takes config.json's place.
  static Hyperparams for_checkpoint(const std::string& folder, const std::string& overrides_json,
                                    const std::string& config_path, const std::string& own_json = {},
                                    const std::string& own_origin = {});
  // Those of a model config's checkpoint, `map`: beside its first file, or a GGUF file's own,
  // with the config's [arch] over them. What the architecture reads and a converter's `arch` is.
  static Hyperparams for_model(const config::ModelConfig& config, const storage::DiskMap& map);

  bool has(std::string_view key) const;  // present and not null
  int64_t integer(std::string_view key) const;  // throws Error when missing or not an integer
  int64_t integer(std::string_view key, int64_t fallback) const;
  double number(std::string_view key) const;
  double number(std::string_view key, double fallback) const;
  bool boolean(std::string_view key, bool fallback) const;
  std::string string(std::string_view key, std::string fallback) const;
  // A nested object (e.g. "rope_parameters"); empty when absent.
  Hyperparams object(std::string_view key) const;

  // The same values, read so that a missing required key (integer(key), number(key)) is noted
  // and read as 1 instead of throwing: an architecture then reads all of its keys, and
  // check_complete() names every missing one in one Error.
  Hyperparams collecting() const;
  void check_complete() const;  // throws Error naming the keys a collecting view found missing
  // A rule between values (n_embd a multiple of n_head): throws Error with `message` when it
  // fails, unless keys are missing already (their placeholders may be what broke it, and
  // check_complete() reports them instead).
  void require(bool holds, const std::string& message) const;

  std::string json() const;  // the merged object
  const std::string& origin() const;

 private:
  struct Impl;
  explicit Hyperparams(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace vramd::hparams
