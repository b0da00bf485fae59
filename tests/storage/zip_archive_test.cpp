#include <catch2/catch.hpp>

#include <zlib.h>

#include <string>
#include <vector>

#include "storage/zip_archive.hpp"
#include "util/error.hpp"

using namespace vramd::storage;
using Catch::Matchers::Contains;

namespace {

std::string le(uint64_t value, int width) {
  std::string out;
  for (int i = 0; i < width; ++i) out += static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

struct Entry {
  std::string name, data;
  uint16_t method = 0;  // stored
  uint64_t size = 0;    // uncompressed size when deflated
  uint32_t crc = 0;
};

Entry stored(std::string name, std::string data) {
  const uint32_t crc = static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size())));
  return Entry{std::move(name), data, 0, data.size(), crc};
}

Entry deflated(std::string name, const std::string& plain) {
  std::string out(compressBound(plain.size()) + 16, '\0');
  z_stream stream{};
  deflateInit2(&stream, 9, Z_DEFLATED, -MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(plain.data()));
  stream.avail_in = static_cast<uInt>(plain.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  deflate(&stream, Z_FINISH);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  Entry entry = stored(std::move(name), plain);
  entry.data = out;
  entry.method = 8;
  return entry;
}

// A plain zip of the entries, local headers with their sizes (no data descriptors).
std::string zip(const std::vector<Entry>& entries) {
  std::string body, directory;
  for (const auto& e : entries) {
    const std::string fields = le(e.method, 2) + le(0, 4) + le(e.crc, 4) + le(e.data.size(), 4) + le(e.size, 4) +
                               le(e.name.size(), 2) + le(0, 2);
    directory += le(0x02014b50, 4) + le(20, 2) + le(20, 2) + le(0, 2) + fields + le(0, 2) + le(0, 2) + le(0, 2) +
                 le(0, 4) + le(body.size(), 4) + e.name;
    body += le(0x04034b50, 4) + le(20, 2) + le(0, 2) + fields + e.name + e.data;
  }
  return body + directory + le(0x06054b50, 4) + le(0, 2) + le(0, 2) + le(entries.size(), 2) + le(entries.size(), 2) +
         le(directory.size(), 4) + le(body.size(), 4) + le(0, 2);
}

std::string refusal(const std::string& bytes) {
  try {
    ZipArchive archive(bytes);
  } catch (const vramd::Error& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("a zip's members are found with their bytes in place") {
  const std::string bytes = zip({stored("a/data.pkl", "pickle"), stored("a/data/0", "0123")});
  ZipArchive archive(bytes);
  REQUIRE(archive.members().size() == 2);
  const ZipMember* record = archive.find("a/data/0");
  REQUIRE(record);
  CHECK(bytes.substr(record->data_offset, record->size) == "0123");
  std::string buffer;
  CHECK(archive.read(*archive.find("a/data.pkl"), 100, buffer) == "pickle");
  CHECK(archive.find("a/data/1") == nullptr);
}

TEST_CASE("a deflated member is inflated within its limit, never handed back raw") {
  const std::string plain(10000, 'x');
  const std::string bytes = zip({deflated("a/data.pkl", plain)});
  ZipArchive archive(bytes);
  const ZipMember& member = archive.members().at(0);
  CHECK(member.deflated);
  std::string buffer;
  CHECK(archive.read(member, 10000, buffer) == plain);
  CHECK_THAT([&] {
    try {
      archive.read(member, 9999, buffer);
    } catch (const vramd::Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  }(), Contains("member 'a/data.pkl' at byte 0 is 10000 bytes, over the limit of 9999"));
}

TEST_CASE("zip members named outside the archive or twice are refused") {
  CHECK_THAT(refusal(zip({stored("a/../../x", "")})), Contains("member 'a/../../x'"));
  CHECK_THAT(refusal(zip({stored("/x", "")})), Contains("not a plain relative path"));
  CHECK_THAT(refusal(zip({stored("a/data.pkl", "1"), stored("a/data.pkl", "2")})),
             Contains("two members are named 'a/data.pkl' (at byte 0 and at byte 41)"));
}

TEST_CASE("zip members whose bytes leave their place are refused") {
  std::string bytes = zip({stored("a/x", "abcd")});
  bytes[18] = 100;  // the local and central stored sizes: 100 bytes, past the central directory
  bytes[22] = 100;
  bytes[37 + 20] = 100;
  bytes[37 + 24] = 100;
  CHECK_THAT(refusal(bytes), Contains("reach past the central directory"));
  CHECK_THAT(refusal("PK\x03\x04 not really"), Contains("no end-of-central-directory record"));
  std::string crc = zip({stored("a/x", "abcd")});
  crc[14] ^= 1;  // the local CRC only
  CHECK_THAT(refusal(crc), Contains("disagrees with the central directory on the CRC or sizes"));
}
