// `vramctl inspect`: prints a checkpoint's index without a daemon.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace vramd::cli {

struct InspectOptions {
  std::vector<std::string> sources;
  std::string prefix;
  bool keep_prefix = false;
  bool json = false;
};

// Writes the index to `out` and warnings to `err`; throws vramd::Error on a bad checkpoint.
void inspect(const InspectOptions& options, std::ostream& out, std::ostream& err);

}  // namespace vramd::cli
