// Reading a small file whole (configs, scripts, request bodies). Checkpoints go through DiskMap.
#pragma once

#include <cstdint>
#include <string>

namespace vramd {

// Caps on files read whole: a model or daemon config, a converter script.
inline constexpr uint64_t kMaxConfigBytes = uint64_t{1} << 20;
// A config.json or modules.json beside a checkpoint (some hold a tokenizer's vocabulary).
inline constexpr uint64_t kMaxJsonBytes = uint64_t{64} << 20;

// The bytes of the regular file at `path` (symlinks followed, as the kernel bounds them).
// Opened without blocking and checked on the descriptor, so a FIFO, a device, a socket, a
// folder, a dangling or looping link, or a file over `max_bytes` is refused at once: throws
// Error "<path>: <why>", the path escaped as escape_invalid_utf8 does. The bytes read are the file as one
// read saw it: a file that grows while it is read is refused, one that shrinks is read short.
std::string read_regular_file(const std::string& path, uint64_t max_bytes);

}  // namespace vramd
