// The daemon's log: one line per event on stderr, "vramd: LEVEL: message", filtered by the
// configured level. Safe to call from any thread.
#pragma once

#include <string>
#include <string_view>

namespace vramd::log {

enum class Level { Error, Warn, Info, Debug };

void set_level(std::string_view level);  // "error" | "warn" | "info" | "debug"
void write(Level level, const std::string& message);

inline void error(const std::string& message) { write(Level::Error, message); }
inline void warn(const std::string& message) { write(Level::Warn, message); }
inline void info(const std::string& message) { write(Level::Info, message); }
inline void debug(const std::string& message) { write(Level::Debug, message); }

}  // namespace vramd::log
