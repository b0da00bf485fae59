// The members of a zip archive (torch.save's container), read from the archive's bytes and all
// checked before any is used, so that a reader never sees a member whose bytes lie outside the
// file, two members with one name, or compressed bytes it takes for plain ones. No LibTorch.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace vramd::storage {

struct ZipMember {
  std::string name;
  uint64_t header_offset = 0;  // of its local header in the archive
  uint64_t data_offset = 0;    // of its bytes (compressed ones when deflated)
  uint64_t stored_size = 0;    // bytes in the archive
  uint64_t size = 0;           // bytes once inflated; equal to stored_size when stored
  uint32_t crc32 = 0;
  bool deflated = false;       // else stored
};

class ZipArchive {
 public:
  // Reads and checks the central directory (zip64 too) of `bytes`, which must outlive the
  // archive. Throws Error naming the member or byte offset for: no end record, a multi-disk or
  // encrypted archive, a method other than stored or deflate, a name that is empty, absolute, not
  // valid UTF-8 or holds '.', '..', empty components or a backslash, two members with one name,
  // a local header that disagrees with the central directory, and member bytes that reach past
  // the central directory or overlap another member's.
  explicit ZipArchive(std::string_view bytes);

  const std::vector<ZipMember>& members() const { return members_; }  // in central-directory order
  const ZipMember* find(std::string_view name) const;

  // The member's bytes: a stored one in place, a deflated one inflated into `buffer`. Refused
  // (Error naming the member and the limit) when it is larger than `limit` bytes, and when its
  // CRC-32 or inflated size disagrees with the central directory.
  std::string_view read(const ZipMember& member, uint64_t limit, std::string& buffer) const;

 private:
  std::string_view bytes_;
  std::vector<ZipMember> members_;
  std::vector<uint32_t> by_name_;  // indexes into members_, sorted by name
};

}  // namespace vramd::storage
