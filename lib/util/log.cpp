#include "util/log.hpp"

#include <atomic>
#include <cstdio>
#include <mutex>

namespace vramd::log {
namespace {
std::atomic<Level> threshold{Level::Info};
std::mutex output;
}  // namespace

void set_level(std::string_view level) {
  threshold = level == "error" ? Level::Error : level == "warn" ? Level::Warn : level == "debug" ? Level::Debug : Level::Info;
}

void write(Level level, const std::string& message) {
  if (level > threshold.load()) return;
  static const char* names[] = {"error", "warn", "info", "debug"};
  std::lock_guard lock(output);
  std::fprintf(stderr, "vramd: %s: %s\n", names[static_cast<int>(level)], message.c_str());
}

}  // namespace vramd::log
