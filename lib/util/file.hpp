// Reading a small file whole (configs, scripts, request bodies). Checkpoints go through DiskMap.
#pragma once

#include <optional>
#include <string>

namespace vramd {

// The file's bytes; nullopt when it cannot be opened.
std::optional<std::string> read_whole_file(const std::string& path);

}  // namespace vramd
