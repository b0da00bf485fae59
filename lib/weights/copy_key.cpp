#include "weights/copy_key.hpp"

#include <sys/stat.h>

#include <bit>
#include <cstdio>

namespace vramd::weights {

namespace {

void append_number(std::string& key, uint64_t n) {
  key += std::to_string(n);
  key += ',';
}

void append_numbers(std::string& key, const std::vector<int64_t>& numbers) {
  key += '[';
  for (const int64_t n : numbers) append_number(key, static_cast<uint64_t>(n));
  key += ']';
}

uint64_t fnv1a(std::string_view text, uint64_t h) {
  for (const unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace

const std::string& CopyKeys::file(uint32_t index) {
  auto [named, fresh] = files_.try_emplace(index);
  if (fresh) {
    struct stat st {};
    if (fstat(map_.descriptor(index), &st) != 0) st = {};  // all zero: a key no other file's matches then by chance alone
    named->second = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" + std::to_string(st.st_size) +
                    ":" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec);
  }
  return named->second;
}

void CopyKeys::append(std::string& key, const convert::Expr& expr) {
  append_number(key, static_cast<uint64_t>(expr.op));
  append_number(key, static_cast<uint64_t>(expr.dtype));
  append_numbers(key, expr.shape);
  append_numbers(key, expr.args);
  append_number(key, std::bit_cast<uint64_t>(expr.factor));
  if (expr.op == convert::Expr::Op::Source) {
    const storage::TensorInfo& info = map_.at(expr.source, expr.shard);
    key += file(info.file);
    key += '@';
    append_number(key, info.offset);
    append_number(key, info.nbytes);
    append_number(key, static_cast<uint64_t>(info.dtype));
    append_numbers(key, info.shape);
  }
  key += '(';
  for (const auto& input : expr.inputs) append(key, *input);
  key += ')';
}

std::string CopyKeys::operator()(const convert::Expr& expr, std::string_view held, std::string_view device) {
  std::string key(held);
  key += '|';
  key += device;
  key += '|';
  append(key, expr);
  return key;
}

std::string copy_span(const std::string& key) {
  char digest[33];
  std::snprintf(digest, sizeof digest, "%016llx%016llx",
                static_cast<unsigned long long>(fnv1a(key, 0xcbf29ce484222325ull)),
                static_cast<unsigned long long>(fnv1a(key, 0x84222325cbf29ce4ull)));
  return std::string(kCopySpan) + digest;
}

}  // namespace vramd::weights
