// Human sizes and durations as configs spell them.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace vramd::config {

// "512MiB", "2GiB", "1.5GB", "4096" (bytes), "64 KiB". Binary units (KiB, MiB, GiB, TiB) are
// powers of 1024, decimal ones (KB, MB, GB, TB) powers of 1000; "K", "M", "G", "T" alone are
// binary. Throws Error with what was expected.
uint64_t parse_size(std::string_view text);

// "30s", "10m", "1h30m", "250ms", "0" (at once), "-1" (forever: nullopt).
std::optional<std::chrono::milliseconds> parse_duration(std::string_view text);

std::string format_duration(std::optional<std::chrono::milliseconds> duration);

}  // namespace vramd::config
