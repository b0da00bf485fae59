#include "server/leases.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "util/format.hpp"
#include "util/log.hpp"

namespace vramd::server {
using nlohmann::json;

std::optional<std::string> in_place_clash(const Entry& entry, const Job& job) {
  if (!job.hold || job.refresh) return std::nullopt;
  for (const auto& [id, lease] : entry.leases) {
    if (lease.in_place == job.in_place) continue;
    const std::string held = "lease " + std::to_string(id) + " (pid " + std::to_string(lease.pid) + ")";
    if (job.in_place)
      return "model " + quote(entry.name) + " is leased by " + held + ", which keeps its values across updates; with " +
             "in_place updates are written into the memory a lease shares: lease without in_place, or once it ends";
    return "model " + quote(entry.name) + " is leased in place by " + held + ": updates are written into the memory " +
           "it shares, which a lease that keeps its values cannot share: lease with in_place, or once it ends";
  }
  return std::nullopt;
}

bool hear(Lease& lease, std::string_view data, const std::string& what, bool& took) {
  lease.said.append(data);
  for (size_t end; (end = lease.said.find('\n')) != std::string::npos;) {
    const json line = json::parse(std::string_view(lease.said).substr(0, end), nullptr, false);
    lease.said.erase(0, end + 1);
    const auto said = [&](const char* key) { return line.size() == 1 && line.contains(key) && line[key].is_number_unsigned(); };
    if (!line.is_object() || !(said("peak") || said("taken"))) {
      log::warn(what + ": its client sent a line that is neither {\"peak\": N} nor {\"taken\": VERSION}; the lease ends");
      return false;
    }
    if (said("peak")) {
      lease.peak = line["peak"].get<uint64_t>();
      continue;
    }
    lease.taken = std::max(lease.taken, std::min(line["taken"].get<uint64_t>(), lease.sent));
    took = true;
  }
  if (lease.said.size() <= 4096) return true;
  log::warn(what + ": its client sent a line past 4 KiB; the lease ends");
  return false;
}

bool send_version(Lease& lease, uint64_t version, const std::string& line, const std::vector<int>& fds,
                  const std::string& what) {
  if (!lease.channel || !lease.channel->send(line, fds)) {
    log::warn(what + ": its client has not taken what was sent before, or is gone; it no longer follows");
    lease.follow = false;
    return false;
  }
  lease.sent = version;
  log::info(what + ": version " + std::to_string(version) + " sent" + (lease.in_place ? " (written in place)" : ""));
  return true;
}

}  // namespace vramd::server
