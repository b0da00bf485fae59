// Runs a Lua converter over a checkpoint's index and returns the target state dict as lazy
// expressions; no tensor data is read. The Lua API is documented in scripts/converters/README.md.
#pragma once

#include <string>
#include <vector>

#include "convert/expr.hpp"
#include "convert/lua_sandbox.hpp"
#include "storage/disk_map.hpp"

namespace vramd::convert {

struct Conversion {
  std::string target;
  ExprPtr expr;
};

struct ConversionPlan {
  std::vector<Conversion> tensors;  // sorted by target name
  std::vector<std::string> unused;  // source keys that no target reads
  std::vector<std::string> printed;  // what the script print()ed
};

// `arch_json`: the model's hyperparameters (a JSON object), which the script sees as the
// read-only table `arch`. Throws Error naming the script (and line, source and target keys
// where they apply).
ConversionPlan run_converter(const std::string& script_path, const storage::DiskMap& source,
                             const std::string& arch_json = "{}", const SandboxLimits& limits = {});
// The same for a script's text, `script_path` naming it in messages.
ConversionPlan run_converter_code(const std::string& code, const std::string& script_path, const storage::DiskMap& source,
                                  const std::string& arch_json = "{}", const SandboxLimits& limits = {});

// The plan without a converter: every source key as itself.
ConversionPlan identity_plan(const storage::DiskMap& source);

}  // namespace vramd::convert
