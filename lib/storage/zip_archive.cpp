#include "storage/zip_archive.hpp"

#include <zlib.h>

#include <algorithm>

#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::storage {
namespace {

constexpr uint32_t kLocalHeader = 0x04034b50, kCentralHeader = 0x02014b50, kEndRecord = 0x06054b50,
                   kZip64EndRecord = 0x06064b50, kZip64Locator = 0x07064b50;
constexpr size_t kLocalHeaderSize = 30, kCentralHeaderSize = 46, kEndRecordSize = 22,
                 kZip64EndRecordSize = 56, kZip64LocatorSize = 20;
constexpr uint16_t kZip64Extra = 0x0001;
constexpr uint32_t kMaxMembers = 1u << 20;  // a torch checkpoint holds one member per storage

std::string at_byte(uint64_t offset) { return "at byte " + std::to_string(offset); }

// Little-endian fields of the archive; every read is checked against the end of `bytes`.
class Fields {
 public:
  explicit Fields(std::string_view bytes) : bytes_(bytes) {}

  bool holds(uint64_t offset, uint64_t count) const {
    return offset <= bytes_.size() && count <= bytes_.size() - offset;
  }
  uint64_t get(uint64_t offset, int width, const std::string& what) const {
    if (!holds(offset, static_cast<uint64_t>(width)))
      throw Error("zip: " + what + " " + at_byte(offset) + " runs past the end of the file");
    uint64_t value = 0;
    for (int i = width - 1; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(bytes_[offset + i]);
    return value;
  }
  std::string_view text(uint64_t offset, uint64_t count, const std::string& what) const {
    if (!holds(offset, count)) throw Error("zip: " + what + " " + at_byte(offset) + " runs past the end of the file");
    return bytes_.substr(offset, count);
  }

 private:
  std::string_view bytes_;
};

struct Directory {
  uint64_t entries = 0, offset = 0, size = 0;
  uint64_t end = 0;  // where the records after the central directory begin
};

Directory find_directory(std::string_view bytes) {
  Fields fields(bytes);
  if (bytes.size() < kEndRecordSize) throw Error("zip: file of " + std::to_string(bytes.size()) + " bytes has no end-of-central-directory record");
  // The end record is the last thing in the file, followed only by its comment.
  uint64_t end_record = bytes.size();
  const uint64_t lowest = bytes.size() > kEndRecordSize + 0xffff ? bytes.size() - kEndRecordSize - 0xffff : 0;
  for (uint64_t at = bytes.size() - kEndRecordSize + 1; at-- > lowest;) {
    if (fields.get(at, 4, "end record") == kEndRecord &&
        at + kEndRecordSize + fields.get(at + 20, 2, "end record") == bytes.size()) {
      end_record = at;
      break;
    }
  }
  if (end_record == bytes.size()) throw Error("zip: no end-of-central-directory record (not a zip file, or truncated)");
  Directory dir;
  const uint64_t disk = fields.get(end_record + 4, 2, "end record"), cd_disk = fields.get(end_record + 6, 2, "end record");
  dir.entries = fields.get(end_record + 10, 2, "end record");
  dir.size = fields.get(end_record + 12, 4, "end record");
  dir.offset = fields.get(end_record + 16, 4, "end record");
  dir.end = end_record;
  const bool zip64_locator =
      end_record >= kZip64LocatorSize && fields.get(end_record - kZip64LocatorSize, 4, "zip64 locator") == kZip64Locator;
  if (zip64_locator) {
    const uint64_t locator = end_record - kZip64LocatorSize;
    const uint64_t record = fields.get(locator + 8, 8, "zip64 locator");
    if (fields.get(locator + 4, 4, "zip64 locator") != 0 || fields.get(locator + 16, 4, "zip64 locator") != 1)
      throw Error("zip: multi-disk archives are not supported (zip64 locator " + at_byte(locator) + ")");
    if (record > locator || locator - record < kZip64EndRecordSize || fields.get(record, 4, "zip64 end record") != kZip64EndRecord)
      throw Error("zip: the zip64 locator " + at_byte(locator) + " points to " + std::to_string(record) +
                  ", where no zip64 end record is");
    if (fields.get(record + 16, 4, "zip64 end record") != 0 || fields.get(record + 20, 4, "zip64 end record") != 0)
      throw Error("zip: multi-disk archives are not supported (zip64 end record " + at_byte(record) + ")");
    const uint64_t on_disk = fields.get(record + 24, 8, "zip64 end record");
    dir.entries = fields.get(record + 32, 8, "zip64 end record");
    if (on_disk != dir.entries) throw Error("zip: multi-disk archives are not supported (zip64 end record " + at_byte(record) + ")");
    dir.size = fields.get(record + 40, 8, "zip64 end record");
    dir.offset = fields.get(record + 48, 8, "zip64 end record");
    dir.end = record;
  } else if (disk != 0 || cd_disk != 0 || fields.get(end_record + 8, 2, "end record") != dir.entries) {
    throw Error("zip: multi-disk archives are not supported (end record " + at_byte(end_record) + ")");
  }
  if (dir.offset > dir.end || dir.size != dir.end - dir.offset)
    throw Error("zip: the central directory is said to span bytes " + std::to_string(dir.offset) + " + " +
                std::to_string(dir.size) + ", but the records after it begin " + at_byte(dir.end));
  if (dir.entries > kMaxMembers)
    throw Error("zip: " + std::to_string(dir.entries) + " members, over the limit of " + std::to_string(kMaxMembers));
  return dir;
}

// A relative path of plain components: nothing a reader could resolve outside the archive.
bool plain_path(std::string_view name) {
  if (name.empty() || !valid_utf8(name)) return false;
  size_t start = 0;
  while (true) {
    const size_t slash = name.find('/', start);
    const std::string_view part = name.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start);
    if (part.empty() || part == "." || part == ".." || part.find('\\') != std::string_view::npos ||
        part.find('\0') != std::string_view::npos)
      return false;
    if (slash == std::string_view::npos) return true;
    start = slash + 1;
  }
}

// The zip64 extended-information field of an extra block: the 64-bit values of the fields whose
// 32-bit slots hold 0xffffffff (0xffff for the disk), in the order the format fixes.
void read_zip64_extra(const Fields& fields, uint64_t extra, uint64_t extra_size, std::initializer_list<uint64_t*> wanted,
                      const std::string& what) {
  uint64_t at = extra;
  while (at + 4 <= extra + extra_size) {
    const uint64_t id = fields.get(at, 2, what), size = fields.get(at + 2, 2, what);
    if (at + 4 + size > extra + extra_size) throw Error("zip: " + what + " has an extra field that runs past its end");
    if (id == kZip64Extra) {
      uint64_t field = at + 4;
      for (uint64_t* value : wanted) {
        if (*value != 0xffffffff) continue;
        if (field + 8 > at + 4 + size) throw Error("zip: " + what + " has a zip64 field too short for its sizes");
        *value = fields.get(field, 8, what);
        field += 8;
      }
      return;
    }
    at += 4 + size;
  }
  for (uint64_t* value : wanted)
    if (*value == 0xffffffff) throw Error("zip: " + what + " needs a zip64 field and has none");
}

}  // namespace

ZipArchive::ZipArchive(std::string_view bytes) : bytes_(bytes) {
  const Fields fields(bytes);
  const Directory dir = find_directory(bytes);
  members_.reserve(dir.entries);
  uint64_t at = dir.offset;
  for (uint64_t i = 0; i < dir.entries; ++i) {
    const std::string where = "central directory entry " + at_byte(at);
    if (fields.get(at, 4, where) != kCentralHeader) throw Error("zip: no " + where);
    const uint64_t flags = fields.get(at + 8, 2, where), method = fields.get(at + 10, 2, where);
    const uint64_t name_size = fields.get(at + 28, 2, where), extra_size = fields.get(at + 30, 2, where),
                   comment_size = fields.get(at + 32, 2, where);
    uint64_t disk = fields.get(at + 34, 2, where);
    ZipMember member;
    member.crc32 = static_cast<uint32_t>(fields.get(at + 16, 4, where));
    member.stored_size = fields.get(at + 20, 4, where);
    member.size = fields.get(at + 24, 4, where);
    member.header_offset = fields.get(at + 42, 4, where);
    member.name = std::string(fields.text(at + kCentralHeaderSize, name_size, where));
    const std::string what = "member " + quote(member.name) + " (" + where + ")";
    if (disk == 0xffff) disk = 0xffffffff;
    read_zip64_extra(fields, at + kCentralHeaderSize + name_size, extra_size,
                     {&member.size, &member.stored_size, &member.header_offset, &disk}, what);
    const uint64_t entry_size = kCentralHeaderSize + name_size + extra_size + comment_size;
    if (entry_size > dir.end - at) throw Error("zip: " + what + " runs past the central directory");
    at += entry_size;

    if (!plain_path(member.name))
      throw Error("zip: " + what + " has a name that is not a plain relative path inside the archive");
    if (disk != 0) throw Error("zip: " + what + " is on another disk; multi-disk archives are not supported");
    if (flags & 0x2041) throw Error("zip: " + what + " is encrypted");
    if (method != 0 && method != 8)
      throw Error("zip: " + what + " uses compression method " + std::to_string(method) + "; only stored and deflate are read");
    member.deflated = method == 8;
    if (!member.deflated && member.stored_size != member.size)
      throw Error("zip: " + what + " is stored but says " + std::to_string(member.stored_size) + " bytes stored, " +
                  std::to_string(member.size) + " bytes long");

    const uint64_t local = member.header_offset;
    const std::string local_what = "member " + quote(member.name) + " (local header " + at_byte(local) + ")";
    if (local >= dir.offset || dir.offset - local < kLocalHeaderSize || fields.get(local, 4, local_what) != kLocalHeader)
      throw Error("zip: no " + local_what);
    const uint64_t local_name_size = fields.get(local + 26, 2, local_what), local_extra_size = fields.get(local + 28, 2, local_what);
    if (fields.get(local + 8, 2, local_what) != method || fields.text(local + kLocalHeaderSize, local_name_size, local_what) != member.name)
      throw Error("zip: " + local_what + " disagrees with the central directory on the name or method");
    if (!(fields.get(local + 6, 2, local_what) & 0x8)) {  // no data descriptor: the local sizes are the real ones
      uint64_t local_stored = fields.get(local + 18, 4, local_what), local_size = fields.get(local + 22, 4, local_what);
      if (local_stored == 0xffffffff || local_size == 0xffffffff)
        read_zip64_extra(fields, local + kLocalHeaderSize + local_name_size, local_extra_size, {&local_size, &local_stored},
                         local_what);
      if (fields.get(local + 14, 4, local_what) != member.crc32 || local_stored != member.stored_size ||
          local_size != member.size)
        throw Error("zip: " + local_what + " disagrees with the central directory on the CRC or sizes");
    }
    member.data_offset = local + kLocalHeaderSize + local_name_size + local_extra_size;
    if (member.data_offset > dir.offset || member.stored_size > dir.offset - member.data_offset)
      throw Error("zip: " + what + ": its " + std::to_string(member.stored_size) + " bytes " + at_byte(member.data_offset) +
                  " reach past the central directory " + at_byte(dir.offset));
    members_.push_back(std::move(member));
  }
  if (at != dir.end) throw Error("zip: the central directory ends " + at_byte(at) + ", not " + at_byte(dir.end));

  std::vector<uint32_t> by_offset(members_.size());
  for (uint32_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
  std::sort(by_offset.begin(), by_offset.end(),
            [&](uint32_t a, uint32_t b) { return members_[a].header_offset < members_[b].header_offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto &before = members_[by_offset[i - 1]], &after = members_[by_offset[i]];
    if (before.data_offset + before.stored_size > after.header_offset)
      throw Error("zip: member " + quote(after.name) + " " + at_byte(after.header_offset) + " overlaps member " +
                  quote(before.name));
  }
  by_name_ = std::move(by_offset);
  std::sort(by_name_.begin(), by_name_.end(), [&](uint32_t a, uint32_t b) { return members_[a].name < members_[b].name; });
  for (size_t i = 1; i < by_name_.size(); ++i)
    if (members_[by_name_[i - 1]].name == members_[by_name_[i]].name)
      throw Error("zip: two members are named " + quote(members_[by_name_[i]].name) + " (" +
                  at_byte(members_[by_name_[i - 1]].header_offset) + " and " + at_byte(members_[by_name_[i]].header_offset) +
                  ")");
}

const ZipMember* ZipArchive::find(std::string_view name) const {
  auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                             [&](uint32_t index, std::string_view n) { return members_[index].name < n; });
  return it != by_name_.end() && members_[*it].name == name ? &members_[*it] : nullptr;
}

std::string_view ZipArchive::read(const ZipMember& member, uint64_t limit, std::string& buffer) const {
  const std::string what = "zip: member " + quote(member.name) + " " + at_byte(member.header_offset);
  if (member.size > limit)
    throw Error(what + " is " + std::to_string(member.size) + " bytes, over the limit of " + std::to_string(limit));
  std::string_view data = bytes_.substr(member.data_offset, member.stored_size);
  if (member.deflated) {
    buffer.assign(member.size, '\0');
    z_stream stream{};
    if (inflateInit2(&stream, -MAX_WBITS) != Z_OK) throw Error(what + ": zlib failed to start");
    stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
    stream.next_out = reinterpret_cast<Bytef*>(buffer.data());
    int status = Z_OK;
    uint64_t in_left = data.size(), out_left = buffer.size();
    while (status == Z_OK) {  // zlib counts in 32 bits: feed it in pieces
      const uInt in_step = static_cast<uInt>(std::min<uint64_t>(in_left, 1u << 30));
      const uInt out_step = static_cast<uInt>(std::min<uint64_t>(out_left, 1u << 30));
      stream.avail_in = in_step;
      stream.avail_out = out_step;
      status = inflate(&stream, Z_NO_FLUSH);
      in_left -= in_step - stream.avail_in;
      out_left -= out_step - stream.avail_out;
      if (status == Z_BUF_ERROR && (in_left == 0 || out_left == 0)) break;
      if (status == Z_BUF_ERROR) status = Z_OK;
    }
    inflateEnd(&stream);
    if (status != Z_STREAM_END || out_left != 0 || in_left != 0)
      throw Error(what + " does not inflate to exactly its declared " + std::to_string(member.size) + " bytes");
    data = buffer;
  }
  if (crc32_z(0, reinterpret_cast<const Bytef*>(data.data()), data.size()) != member.crc32)
    throw Error(what + " fails its CRC-32 check");
  return data;
}

}  // namespace vramd::storage
