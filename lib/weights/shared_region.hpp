// Host memory that clients may map but never change: one memfd per region, filled through a
// writable mapping of the daemon's own, then sealed against writes, growth and shrinking
// before anyone else sees it. The daemon computes with the same pages through a read-only
// mapping made after the seal (before it, even a read-only shared mapping would keep the
// kernel from sealing), so no client can change what another client or the daemon computes with.
// A client's sealed memfd whose values a model takes as they are (an update) becomes a region too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "util/unique_fd.hpp"

namespace vramd::weights {

class SharedRegion {
 public:
  // `size` bytes (more than 0) of zeroed memory named `name` (seen in /proc/PID/maps as
  // "memfd:NAME"). Throws Error naming it when memory or descriptors run out.
  static std::shared_ptr<SharedRegion> create(uint64_t size, const std::string& name);
  // Somebody else's memfd, already sealed against shrinking, and against writes too where its
  // values must never change (the caller checks: a kept memfd's client writes the next update
  // into it), `size` bytes of it mapped read-only: a region from the start. Throws Error naming
  // `what` when the mapping fails.
  static std::shared_ptr<SharedRegion> adopt(UniqueFd fd, uint64_t size, const std::string& what);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  uint64_t size() const { return size_; }
  int fd() const { return fd_.get(); }
  // After seal(): the pages as the daemon reads them (read-only).
  const std::byte* data() const { return read_; }
  // Before seal(): where to write them.
  std::byte* writable() const { return write_; }
  bool sealed() const { return write_ == nullptr; }
  bool contains(const void* p) const { return p >= read_ && p < read_ + size_; }

  // Drops the writable mapping, seals the memfd (F_SEAL_WRITE, F_SEAL_GROW, F_SEAL_SHRINK,
  // F_SEAL_SEAL: from now on nobody, the daemon included, can change a byte) and maps it
  // read-only. Throws Error when the kernel refuses.
  void seal();

 private:
  SharedRegion() = default;
  UniqueFd fd_;
  uint64_t size_ = 0;
  std::byte* read_ = nullptr;
  std::byte* write_ = nullptr;
};

}  // namespace vramd::weights
