// libFuzzer target: a family file (docs/architectures.md) is TOML a user drops into one of the
// daemon's architecture folders, so any text there becomes a Family or one vramd::Error whose
// every line is valid UTF-8 and names the file; nothing else may happen.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "family/family.hpp"
#include "refusal.hpp"
#include "util/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string origin = "/nonexistent/vramd-fuzz/architectures/fuzz.toml";
  try {
    vramd::family::parse_family("fuzz", std::string(reinterpret_cast<const char*>(data), size), origin);
  } catch (const vramd::Error& e) {
    if (!names_the_file_on_every_line(e.what(), origin)) std::abort();
  }
  return 0;
}
