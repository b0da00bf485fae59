// The lease protocol's decisions, apart from the registry that runs them: which leases may share a
// model's memory, what a lease's client says on its connection ({"peak": N}, {"taken": VERSION})
// and sending it a new version. docs/api.md documents the protocol.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/entry.hpp"
#include "server/job.hpp"

namespace vramd::server {

// A lease that takes updates in place and one that keeps its values cannot share a model's GPU
// memory: what the lease `job` asks for would clash with, said, or nothing.
std::optional<std::string> in_place_clash(const Entry& entry, const Job& job);

// What a lease's client says: `data` is appended to its unfinished line and every whole line read,
// {"peak": N} (the most it has used of its reservation) or {"taken": VERSION} (it took a
// version sent before: `took` is set). False (the lease ends, warned of naming `what`) for any
// other line, or one past 4 KiB.
bool hear(Lease& lease, std::string_view data, const std::string& what, bool& took);

// `line` (and `fds`) to a following lease as its `version`; false, and it follows no more (warned
// of naming `what`), when its client has not taken the version sent before, or is gone.
bool send_version(Lease& lease, uint64_t version, const std::string& line, const std::vector<int>& fds,
                  const std::string& what);

}  // namespace vramd::server
