// Names for the copies resident weights make of a checkpoint's tensors (cast to another dtype,
// converted, or read around the page cache), so that configs of one checkpoint hold one copy of
// each weight they hold alike (weights/resident.cpp) and the daemon's budgets count it once (a
// model::FileSpans span named copy_span(key), server/budget.hpp). LibTorch-free.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "convert/expr.hpp"
#include "storage/disk_map.hpp"

namespace vramd::weights {

// The prefix of the FileSpans names of copies; a page of a file is named by its identity alone.
inline constexpr std::string_view kCopySpan = "copy:";

class CopyKeys {
 public:
  explicit CopyKeys(const storage::DiskMap& map) : map_(map) {}

  // What `expr` evaluates to from the map's files as they are now, held as `held` on `device`:
  // the expression exactly (every operation, argument and factor), and for each tensor it reads,
  // its file's identity, size and modification time, its offset, bytes, dtype and shape. Equal
  // keys, equal values; a file written again is another key.
  std::string operator()(const convert::Expr& expr, std::string_view held, std::string_view device);

 private:
  void append(std::string& key, const convert::Expr& expr);
  const std::string& file(uint32_t index);

  const storage::DiskMap& map_;
  std::map<uint32_t, std::string> files_;
};

// The FileSpans name of the copy `key` names: kCopySpan and a 128-bit digest of the key.
std::string copy_span(const std::string& key);

}  // namespace vramd::weights
