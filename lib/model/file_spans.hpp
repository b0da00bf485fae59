// Byte ranges of checkpoint files that a model's weights are views of: pages of the page cache,
// which every model viewing them shares, so that the daemon's budgets count them once however
// many configs of one checkpoint are loaded (server/budget.hpp). Files are named by identity
// (device and inode), not path: a link or another spelling of the path is the same file, and a
// file replaced under one name is another. The copies that configs of one checkpoint share
// (weights/copy_key.hpp) are counted the same way, each as a file of its own. LibTorch-free.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace vramd::model {

class FileSpans {
 public:
  // [begin, end) of the file `file` ("DEV:INODE"); overlapping and adjacent ranges merge.
  void add(const std::string& file, uint64_t begin, uint64_t end);
  void add(const FileSpans& other);

  uint64_t bytes() const;                          // of all the ranges, each byte once
  uint64_t overlap(const FileSpans& other) const;  // bytes in both
  // The files whose names begin with `prefix` (`matching`), or the others.
  FileSpans named(std::string_view prefix, bool matching = true) const;
  bool empty() const { return files_.empty(); }
  bool operator==(const FileSpans&) const = default;

 private:
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;  // sorted, disjoint, not adjacent
  std::map<std::string, Ranges> files_;
};

// The identity of the file open as `fd`, as FileSpans names it; empty when fstat fails.
std::string file_identity(int fd);

}  // namespace vramd::model
