// Reading a small file whole (configs, scripts, request bodies). Checkpoints go through DiskMap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace vramd {

// Caps on files read whole: a model or daemon config; a converter script (one written for a
// checkpoint names each of its tensors: a mixture of 128 experts in 94 layers has 36,000).
inline constexpr uint64_t kMaxConfigBytes = uint64_t{1} << 20;
inline constexpr uint64_t kMaxScriptBytes = uint64_t{16} << 20;
// A config.json or modules.json beside a checkpoint (some hold a tokenizer's vocabulary).
inline constexpr uint64_t kMaxJsonBytes = uint64_t{64} << 20;

struct OpenedFile {
  int fd = -1;         // the caller's to close
  uint64_t size = 0;
};

// Opens the regular file at `path` read-only (symlinks followed, as the kernel bounds them),
// without blocking and checked on the descriptor: a FIFO, a device, a socket, a folder, a
// dangling or looping link is refused at once. Throws Error "<path>: <why>", the path escaped
// as escape_invalid_utf8 does, naming what the file is when it is not regular.
OpenedFile open_regular_file(const std::string& path);

// The bytes of the regular file at `path`, opened as open_regular_file does; a file over
// `max_bytes` is refused too. The bytes read are the file as one read saw it: a file that grows
// while it is read is refused, one that shrinks is read short.
std::string read_regular_file(const std::string& path, uint64_t max_bytes);

// Writes all `size` bytes at `data` to `fd` (again after EINTR or a short write). Throws Error
// "<path>: write failed: <why>".
void write_all(int fd, const void* data, size_t size, const std::string& path);

}  // namespace vramd
