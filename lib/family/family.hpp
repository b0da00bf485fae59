// A model family as data: which of a checkpoint's hyperparameters (config.json) set which
// switches of the one block engine (model/engine.cpp), which switches are fixed for the whole
// family, and which module names hold which weights. A family is a TOML file
// (configs/architectures/*.toml, docs/architectures.md); this parses and checks one, so that a
// mistake in it is reported with file:line:column before any checkpoint is read. Torch-free.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace vramd::family {

// The value of a switch, kept as the JSON text it stands for ("true", "1e-06", "\"silu\"").
using JsonText = std::string;

// Where a switch's value comes from for one checkpoint.
struct SwitchSource {
  std::optional<JsonText> fixed = {};           // [switches]: the same for every checkpoint
  std::vector<std::string> keys = {};           // [hyperparameters]: the first of these present
  std::optional<JsonText> fallback = {};        // when none is present (else the engine's default)
  std::map<std::string, JsonText> mapped = {};  // value as text ("gated-gelu", "true") -> switch value
  bool required = false;                        // a missing key is an error, not the engine's default
  std::string only_if = {};                     // a boolean config key: unless it is true, as if null
  uint32_t line = 0;                       // in the family file, for messages
};

// A module name, or two chosen by a boolean switch (T5's `wi` or `wi_1`, as its MLP is gated).
struct NameSource {
  std::string name = {};
  std::string condition = {};  // a boolean switch; empty: always `name`
  std::string otherwise = {};  // the name when `condition` is false
  uint32_t line = 0;
};

// The slots made before the blocks, in the order most architectures register them (BERT's).
inline const std::vector<std::string> kEmbeddingSlots = {"embed_tokens", "embed_positions", "embed_types", "embed_norm"};

struct Family {
  std::string name;     // what `architecture = "..."` names
  std::string origin;   // the file, or "built-in family llama" for a shipped one
  std::string summary;
  std::string extends;  // the family this one starts from (inherit() merges them)
  std::vector<std::string> model_types;  // config.json's model_type values it computes
  std::string base_prefix;               // of the base model's names inside one with a head
  std::vector<std::string> ignored;      // checkpoint key suffixes it does not load
  std::map<std::string, SwitchSource> switches;
  std::map<std::string, NameSource> names;  // slot -> module path; per-layer slots below `layer`
  std::vector<std::string> optional;        // slots made only when the checkpoint holds their weight
  // The embedding slots in the order the architecture registers its modules (device maps place
  // units in that order); empty: kEmbeddingSlots' order.
  std::vector<std::string> embedding_order;
  std::map<std::string, std::vector<JsonText>> required_values;  // [requires]: config key -> the values it may have
};

// Parses a family file's text. `name` is the family's name (the file's stem). Throws Error
// with every problem at once, each as "<origin>:<line>:<column>: <key>: <what is wrong>".
Family parse_family(const std::string& name, const std::string& text, const std::string& origin);

// `derived` over the family it extends: its switches, names and requirements replace or add to
// the base's (a name set to "" removes that module), its ignored suffixes add to them, and its
// model_types, summary and origin are its own. Throws Error when the result names no layer.
Family inherit(const Family& base, const Family& derived);

}  // namespace vramd::family
