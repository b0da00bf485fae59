// The daemon's log: one line per event, filtered by the configured level, on stderr as
// "vramd: LEVEL: message" (under systemd, whose JOURNAL_STREAM names stderr, with syslog's
// "<N>" priority in front, so that `journalctl -p warning` filters it), and in a file when one
// is configured ("2026-11-25T02:40:00Z vramd: LEVEL: message", appended). Safe from any thread.
#pragma once

#include <string>
#include <string_view>

namespace vramd::log {

enum class Level { Error, Warn, Info, Debug };

void set_level(std::string_view level);  // "error" | "warn" | "info" | "debug"
// Appends every line to `path` too, from now on (O_APPEND: rotate it with copytruncate). Throws
// Error naming the file when it cannot be opened.
void open_file(const std::string& path);
void write(Level level, const std::string& message);
// Whether a line at `level` is written: for messages that cost building on a hot path.
bool enabled(Level level);

inline void error(const std::string& message) { write(Level::Error, message); }
inline void warn(const std::string& message) { write(Level::Warn, message); }
inline void info(const std::string& message) { write(Level::Info, message); }
inline void debug(const std::string& message) { write(Level::Debug, message); }

}  // namespace vramd::log
