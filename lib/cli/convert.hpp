// `vramctl convert`: runs a model's converter over its checkpoint index (no tensor data is
// read) and prints each target key with its dtype, shape and the expression that makes it.
// With an output file it evaluates every target and writes the converted checkpoint.
#pragma once

#include <iosfwd>
#include <string>

namespace vramd::cli {

struct ConvertOptions {
  std::string config;
  std::string daemon_config;  // as for check
  bool json = false;
  std::string output;  // evaluate every target and write them to this safetensors file
};

// Throws vramd::Error naming the config or the script.
void convert(const ConvertOptions& options, std::ostream& out, std::ostream& err);

}  // namespace vramd::cli
