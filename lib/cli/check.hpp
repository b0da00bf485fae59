// `vramctl check`: validates model configs offline: syntax, schema, consistency with the
// daemon's config, that the checkpoint's index can be read, and a dry run of the converter
// (which reads no tensor data).
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace vramd::cli {

struct CheckOptions {
  std::vector<std::string> configs;
  std::string daemon_config;  // empty: configs/vramd.toml when it exists, else built-in defaults
  bool json = false;
};

// Prints one verdict per config; returns how many failed.
int check(const CheckOptions& options, std::ostream& out, std::ostream& err);

}  // namespace vramd::cli
