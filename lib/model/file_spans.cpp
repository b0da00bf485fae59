#include "model/file_spans.hpp"

#include <sys/stat.h>

#include <algorithm>

namespace vramd::model {

void FileSpans::add(const std::string& file, uint64_t begin, uint64_t end) {
  if (begin >= end) return;
  Ranges& ranges = files_[file];
  // The first range that ends at or after `begin`: every range before it stays as it is.
  auto first = std::lower_bound(ranges.begin(), ranges.end(), begin,
                                [](const auto& range, uint64_t at) { return range.second < at; });
  auto last = first;
  while (last != ranges.end() && last->first <= end) {
    begin = std::min(begin, last->first);
    end = std::max(end, last->second);
    ++last;
  }
  first = ranges.erase(first, last);
  ranges.insert(first, {begin, end});
}

void FileSpans::add(const FileSpans& other) {
  for (const auto& [file, ranges] : other.files_)
    for (const auto& [begin, end] : ranges) add(file, begin, end);
}

uint64_t FileSpans::bytes() const {
  uint64_t total = 0;
  for (const auto& [file, ranges] : files_)
    for (const auto& [begin, end] : ranges) total += end - begin;
  return total;
}

uint64_t FileSpans::overlap(const FileSpans& other) const {
  uint64_t total = 0;
  for (const auto& [file, mine] : files_) {
    const auto theirs = other.files_.find(file);
    if (theirs == other.files_.end()) continue;
    auto a = mine.begin(), b = theirs->second.begin();
    while (a != mine.end() && b != theirs->second.end()) {
      const uint64_t begin = std::max(a->first, b->first), end = std::min(a->second, b->second);
      if (begin < end) total += end - begin;
      (a->second < b->second ? a : b)++;
    }
  }
  return total;
}

FileSpans FileSpans::named(std::string_view prefix, bool matching) const {
  FileSpans out;
  for (const auto& [file, ranges] : files_)
    if (file.starts_with(prefix) == matching) out.files_.emplace(file, ranges);
  return out;
}

std::string file_identity(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return {};
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

}  // namespace vramd::model
