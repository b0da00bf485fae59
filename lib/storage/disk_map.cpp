#include "storage/disk_map.hpp"

#include <glob.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "storage/checkpoint_parts.hpp"
#include "storage/dcp_metadata.hpp"
#include "storage/file.hpp"
#include "storage/gguf.hpp"
#include "storage/safetensors_header.hpp"
#include "storage/torch_pickle.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/sort.hpp"
#include "util/utf8.hpp"

namespace vramd::storage {
namespace fs = std::filesystem;

uint64_t TensorInfo::elements() const { return element_count(shape); }

struct DiskMap::Impl {
  std::string description;
  std::vector<CheckpointFile> files;
  std::vector<std::unique_ptr<File>> handles;  // one per file
  std::vector<TensorInfo> tensors;             // sorted by name
  std::vector<std::string> warnings;
  uint64_t total_bytes = 0;
  std::atomic<uint64_t> bytes_read{0};
};

namespace {

// A file's first four bytes (fewer for a shorter file): what it is, whatever its name.
std::vector<std::byte> magic(const File& file) {
  std::vector<std::byte> bytes(std::min<uint64_t>(file.size(), 4));
  file.read(bytes, 0);
  return bytes;
}

// The header of a GGUF file, read as far as it goes and no further: a megabyte, then more.
GgufHeader read_gguf_header(const File& file) {
  std::vector<std::byte> bytes(std::min<uint64_t>(file.size(), 1 << 20));
  for (;;) {
    file.read(bytes, 0);
    try {
      return parse_gguf(bytes, file.size());
    } catch (const GgufNeedsMore& more) {
      bytes.resize(std::max<uint64_t>(more.needed, std::min<uint64_t>({2 * bytes.size(), file.size(), kMaxGgufHeaderSize})));
    }
  }
}

bool looks_like_zip(std::span<const std::byte> magic) {
  return magic.size() == 4 && std::memcmp(magic.data(), "PK\x03\x04", 4) == 0;
}

struct Indexer {
  DiskMap::Impl& map;
  const DiskMapOptions& options;
  uint64_t keys_seen = 0;
  std::vector<std::string> sample_keys;

  // A key the file holds, counted for the error when no key has the prefix.
  void count(const std::string& key) {
    ++keys_seen;
    if (sample_keys.size() < 3) sample_keys.push_back(key);
  }
  // Whether the map takes the key (it starts with the prefix). `path`: its file, for the error
  // when the prefix would leave it no name.
  bool takes(const std::string& key, const std::string& path) const {
    if (!key.starts_with(options.prefix)) return false;
    if (options.strip_prefix && !options.prefix.empty() && key.size() == options.prefix.size())
      fail(path, "key " + quote(key) + " equals the prefix, which leaves it no name");
    return true;
  }
  uint32_t prefix_length() const { return options.strip_prefix ? static_cast<uint32_t>(options.prefix.size()) : 0; }

  void add(const Part& part, std::vector<TensorRecord> records, uint64_t data_offset) {
    const auto file = static_cast<uint32_t>(map.files.size() - 1);
    const std::string& path = map.files.back().path;
    std::set<std::string> missing = part.only.value_or(std::set<std::string>{});
    uint64_t unlisted = 0;
    for (auto& record : records) {
      count(record.name);
      if (part.only) {
        if (!part.only->count(record.name)) {
          ++unlisted;
          continue;
        }
        missing.erase(record.name);
      }
      if (!takes(record.name, path)) continue;
      TensorInfo info;
      info.prefix_length = prefix_length();
      info.key = std::move(record.name);
      info.dtype = record.dtype;
      info.shape = std::move(record.shape);
      info.file = file;
      info.offset = data_offset + record.begin;
      info.nbytes = record.end - record.begin;
      map.total_bytes += info.nbytes;
      map.tensors.push_back(std::move(info));
    }
    if (!missing.empty()) {
      std::string names;
      size_t shown = 0;
      for (const auto& key : missing) {
        if (shown++ == 5) break;
        names += (names.empty() ? "" : ", ") + quote(key);
      }
      if (missing.size() > 5) names += ", ...";
      fail(part.index, std::to_string(missing.size()) + " key(s) named in weight_map are not in " +
                           path + ": " + names);
    }
    if (unlisted)
      map.warnings.push_back(path + ": " + std::to_string(unlisted) + " tensor(s) not named in " +
                             part.index + " were ignored");
  }
};

// One file's tensors, wherever its format keeps them (data_offset: where their offsets count from).
struct FileIndex {
  std::vector<TensorRecord> tensors;
  uint64_t data_offset = 0;
};

// Indexes the file as its first bytes (else its name) say it is, filling in its format and
// metadata. Errors name the file.
FileIndex index_file(const std::string& path, const File& file, CheckpointFile& info, const DiskMapOptions& options,
                     std::vector<std::string>& warnings) {
  const auto first_bytes = magic(file);
  try {
    if (is_gguf(first_bytes) || ends_with(path, ".gguf")) {
      info.format = FileFormat::Gguf;
      auto header = read_gguf_header(file);
      info.metadata = std::move(header.metadata);
      return {std::move(header.tensors), header.data_offset};
    }
    if (is_pickle_name(path) || (!ends_with(path, ".safetensors") && looks_like_zip(first_bytes))) {
      info.format = FileFormat::TorchPickle;
      const auto bytes = file.mapping();
      auto index = index_torch_pickle({reinterpret_cast<const char*>(bytes.data()), bytes.size()}, options.prefix);
      file.check_mappings();
      if (index.skipped)
        warnings.push_back(path + ": " + std::to_string(index.skipped) + " entries that are not tensors were left out");
      return {std::move(index.tensors), 0};
    }
    auto header = read_safetensors_header(file.fd(), file.size());
    info.metadata = std::move(header.metadata);
    return {std::move(header.tensors), header.data_offset};
  } catch (const ReadFailure&) {
    throw;  // names the file already
  } catch (const Error& e) {
    file.check_mappings();  // zeros where a mapped file was cut short: say that, not what they look like
    fail(path, e.what());
  }
}

// Whether two chunks of one tensor share an element.
bool overlap(const TensorInfo& a, const TensorInfo& b) {
  for (size_t d = 0; d < a.shape.size(); ++d)
    if (a.chunk_offsets[d] >= b.chunk_offsets[d] + b.shape[d] || b.chunk_offsets[d] >= a.chunk_offsets[d] + a.shape[d])
      return false;
  return true;
}

constexpr size_t kMaxDcpChunks = 4096;  // of one tensor: its chunks are checked pairwise

// A torch.distributed.checkpoint folder: .metadata (storage/dcp_metadata.hpp) says which
// chunks make each tensor and where each lies, in __R_W.distcp files that hold either one
// torch.save archive a chunk or a safetensors file. Each chunk becomes a shard of its name, read
// where it lies; the chunks of a name must tile its shape (no gap, no overlap). Errors name the
// file at fault.
void add_dcp(const Part& part, Indexer& indexer) {
  DiskMap::Impl& map = indexer.map;
  const File metadata_file(part.path);
  if (metadata_file.size() > kMaxDataPklBytes)
    fail(part.path, "is " + format_bytes(metadata_file.size()) + ", more than the " + format_bytes(kMaxDataPklBytes) +
                        " a DCP .metadata may be");
  std::string raw(metadata_file.size(), '\0');
  metadata_file.read({reinterpret_cast<std::byte*>(raw.data()), raw.size()}, 0);
  DcpMetadata metadata;
  try {
    metadata = read_dcp_metadata(raw);
  } catch (const Error& e) {
    fail(part.path, e.what());
  }
  const fs::path folder = fs::path(part.path).parent_path();
  std::map<std::string, uint32_t> opened;  // chunk file -> index in map.files
  std::map<uint32_t, SafetensorsHeader> headers;
  const auto open_file = [&](const std::string& name, const std::string& tensor) -> uint32_t {
    if (const auto found = opened.find(name); found != opened.end()) return found->second;
    const std::string path = (folder / name).string();
    std::error_code ec;
    if (!fs::is_regular_file(path, ec))
      fail(part.path, "names the chunk file " + quote(name) + " (for " + quote(tensor) + "), which is not in " +
                          folder.string());
    auto handle = std::make_unique<File>(path);
    const auto index = static_cast<uint32_t>(map.files.size());
    CheckpointFile info{path, looks_like_zip(magic(*handle)) ? FileFormat::TorchPickle : FileFormat::Safetensors,
                        handle->size(), {}};
    if (info.format == FileFormat::Safetensors) try {
        headers.emplace(index, read_safetensors_header(handle->fd(), handle->size()));
      } catch (const ReadFailure&) {
        throw;
      } catch (const Error& e) {
        fail(path, std::string(e.what()) + " (neither a torch.save chunk nor a safetensors file)");
      }
    map.files.push_back(std::move(info));
    map.handles.push_back(std::move(handle));
    opened.emplace(name, index);
    return index;
  };

  for (auto& tensor : metadata.tensors) {
    indexer.count(tensor.name);
    if (!indexer.takes(tensor.name, part.path)) continue;
    if (tensor.chunks.size() > kMaxDcpChunks)
      fail(part.path, quote(tensor.name) + " is saved in " + std::to_string(tensor.chunks.size()) + " chunks, more than " +
                          std::to_string(kMaxDcpChunks) + " (the limit)");
    const size_t first = map.tensors.size();
    uint64_t covered = 0;
    for (const auto& chunk : tensor.chunks) {
      const uint64_t elements = element_count(chunk.sizes);
      if (elements == 0) continue;  // an empty rank's chunk: nothing to read
      const uint32_t file = open_file(chunk.file, tensor.name);
      const CheckpointFile& info = map.files[file];
      const std::string what = "the chunk of " + quote(tensor.name) + " at " + format_shape(chunk.offsets);
      const std::string bytes_text = "bytes [" + std::to_string(chunk.offset) + ", " + std::to_string(chunk.offset + chunk.length) + ")";
      if (chunk.offset > info.size || chunk.length > info.size - chunk.offset)
        fail(info.path, what + " spans " + bytes_text + ", past the file's " + std::to_string(info.size) + " bytes");
      TensorRecord record;
      uint64_t base = 0;
      if (info.format == FileFormat::TorchPickle) {
        const auto bytes = map.handles[file]->mapping().subspan(chunk.offset, chunk.length);
        PickleIndex index;
        try {
          index = index_torch_pickle({reinterpret_cast<const char*>(bytes.data()), bytes.size()}, "", PickleRoot::Tensor);
          map.handles[file]->check_mappings();
        } catch (const ReadFailure&) {
          throw;
        } catch (const Error& e) {
          map.handles[file]->check_mappings();
          fail(info.path, what + ", " + bytes_text + ": " + e.what());
        }
        if (index.tensors.size() != 1) fail(info.path, what + ", " + bytes_text + ": not one contiguous tensor");
        record = std::move(index.tensors[0]);
        base = chunk.offset;
      } else {
        const auto& header = headers.at(file);
        const auto found = std::lower_bound(header.tensors.begin(), header.tensors.end(), tensor.name,
                                            [](const TensorRecord& r, const std::string& name) { return r.name < name; });
        if (found == header.tensors.end() || found->name != tensor.name) fail(info.path, "holds no tensor " + quote(tensor.name) + " for " + what);
        if (chunk.offset != 0 || chunk.length != found->end - found->begin)
          fail(info.path, what + " is " + bytes_text + " of its tensor, which holds " +
                              std::to_string(found->end - found->begin));
        record = *found;
        base = header.data_offset;
      }
      if (record.dtype != tensor.dtype || record.shape != chunk.sizes)
        fail(info.path, what + " holds " + std::string(dtype_name(record.dtype)) + " " + format_shape(record.shape) +
                            "; the .metadata says " + std::string(dtype_name(tensor.dtype)) + " " +
                            format_shape(chunk.sizes));
      TensorInfo out;
      out.key = tensor.name;
      out.prefix_length = indexer.prefix_length();
      out.dtype = tensor.dtype;
      out.shape = chunk.sizes;
      out.file = file;
      out.offset = base + record.begin;
      out.nbytes = record.end - record.begin;
      out.chunk = true;
      out.chunk_offsets = chunk.offsets;
      out.whole = tensor.shape;
      for (size_t i = first; i < map.tensors.size(); ++i)
        if (overlap(map.tensors[i], out))
          fail(part.path, what + " overlaps the one at " + format_shape(map.tensors[i].chunk_offsets));
      covered += elements;
      map.total_bytes += out.nbytes;
      map.tensors.push_back(std::move(out));
    }
    if (covered != element_count(tensor.shape))
      fail(part.path, "the chunks of " + quote(tensor.name) + " cover " + std::to_string(covered) + " of its " +
                          std::to_string(element_count(tensor.shape)) + " elements " + format_shape(tensor.shape) +
                          ": a chunk is missing");
  }
  if (metadata.skipped)
    map.warnings.push_back(part.path + ": " + std::to_string(metadata.skipped) +
                           " entries that are not tensors (training state) were left out");
}

}  // namespace

DiskMap DiskMap::open(const std::string& source, const DiskMapOptions& options) {
  return open(std::vector<std::string>{source}, options);
}

DiskMap DiskMap::open(const std::vector<std::string>& sources, const DiskMapOptions& options) {
  auto impl = std::make_shared<Impl>();
  for (const auto& source : sources) impl->description += (impl->description.empty() ? "" : ", ") + source;
  if (sources.empty()) throw Error("no checkpoint given");

  const std::vector<Part> parts = checkpoint_parts(sources, impl->warnings);

  Indexer indexer{*impl, options, 0, {}};
  for (const auto& part : parts) {
    if (part.dcp) {
      add_dcp(part, indexer);
      continue;
    }
    auto handle = std::make_unique<File>(part.path);
    CheckpointFile info{part.path, FileFormat::Safetensors, handle->size(), {}};
    auto index = index_file(part.path, *handle, info, options, impl->warnings);
    impl->files.push_back(std::move(info));
    impl->handles.push_back(std::move(handle));
    indexer.add(part, std::move(index.tensors), index.data_offset);
  }

  if (impl->tensors.empty() && !options.prefix.empty()) {
    std::string examples;
    for (const auto& key : indexer.sample_keys) examples += (examples.empty() ? "" : ", ") + quote(key);
    fail(impl->description, "no key starts with the prefix " + quote(options.prefix) + " (" +
                                std::to_string(indexer.keys_seen) + " keys, such as " + examples + ")");
  }
  // A single safetensors file arrives sorted already: stripping a prefix keeps the order.
  // sort_by is stable, so a name several files hold stays in file order.
  sort_by(impl->tensors, [](const TensorInfo& t) { return t.name(); });
  for (size_t i = 1; i < impl->tensors.size(); ++i) {
    auto& earlier = impl->tensors[i - 1];
    auto& tensor = impl->tensors[i];
    if (earlier.name() != tensor.name()) continue;
    const auto& path = impl->files[tensor.file].path;
    if (earlier.chunk && tensor.chunk && earlier.whole == tensor.whole) {  // chunks of one DCP tensor
      tensor.shard = earlier.shard + 1;
      continue;
    }
    if (earlier.file == tensor.file) fail(path, "holds the key " + quote(tensor.key) + " twice");
    if (!options.shards)
      fail(path, "holds the key " + quote(tensor.key) + ", which " + impl->files[earlier.file].path +
                     " holds too; when each file holds a slice of every tensor (tensor-parallel shards, as "
                     "Meta's consolidated.NN.pth), a converter joins them: src:shards(name) gives each "
                     "file's slice (scripts/converters/meta_llama.lua does this)");
    tensor.shard = earlier.shard + 1;
  }
  return DiskMap(std::move(impl));
}

std::span<const TensorInfo> DiskMap::tensors() const { return impl_->tensors; }
std::span<const CheckpointFile> DiskMap::files() const { return impl_->files; }
std::span<const std::string> DiskMap::warnings() const { return impl_->warnings; }
const std::string& DiskMap::description() const { return impl_->description; }
uint64_t DiskMap::total_bytes() const { return impl_->total_bytes; }

const TensorInfo* DiskMap::find(std::string_view name) const {
  const auto found = shards(name);
  return found.empty() ? nullptr : &found.front();
}

std::span<const TensorInfo> DiskMap::shards(std::string_view name) const {
  const auto& tensors = impl_->tensors;
  auto begin = std::lower_bound(tensors.begin(), tensors.end(), name,
                                [](const TensorInfo& t, std::string_view n) { return t.name() < n; });
  auto end = std::find_if(begin, tensors.end(), [&](const TensorInfo& t) { return t.name() != name; });
  return {begin, end};
}

const TensorInfo& DiskMap::at(std::string_view name, uint32_t shard) const {
  const auto found = shards(name);
  if (found.empty()) fail(impl_->description, "has no tensor " + quote(name));
  if (shard >= found.size())
    fail(impl_->description, "holds " + quote(name) + " in " + std::to_string(found.size()) + " files, not " +
                                 std::to_string(shard + 1));
  return found[shard];
}

void DiskMap::read(const TensorInfo& info, std::span<std::byte> dst) const {
  if (dst.size() != info.nbytes)
    fail(std::string(info.name()), "read into a buffer of " + std::to_string(dst.size()) + " bytes, needs " +
                        std::to_string(info.nbytes));
  read_file(info.file, dst, info.offset, false);
}

void DiskMap::read_direct(const TensorInfo& info, std::span<std::byte> dst) const {
  if (dst.size() != info.nbytes) return read(info, dst);  // which reports the mismatch
  read_file(info.file, dst, info.offset, true);
}

void DiskMap::read_file(uint32_t file, std::span<std::byte> dst, uint64_t offset, bool direct) const {
  const Range range{file, offset, dst};
  read_ranges({&range, 1}, {.direct = direct});
}

void DiskMap::read_ranges(std::span<const Range> ranges, const ReaderOptions& options) const {
  std::vector<ReadRange> resolved;
  resolved.reserve(ranges.size());
  for (const auto& range : ranges) {
    resolved.push_back({impl_->handles.at(range.file).get(), range.offset, range.dst});
    impl_->bytes_read += range.dst.size();
  }
  storage::read_ranges(resolved, options);
}

void DiskMap::read_staged(std::span<const Staged> ranges, StagingPool& pool, const ReaderOptions& options) const {
  std::vector<StagedRange> resolved;
  resolved.reserve(ranges.size());
  for (const auto& range : ranges) {
    resolved.push_back({impl_->handles.at(range.file).get(), range.offset, range.size});
    impl_->bytes_read += range.size;
  }
  storage::read_staged(resolved, pool, options);
}

std::pair<std::span<std::byte>, std::shared_ptr<void>> DiskMap::bytes(const TensorInfo& info) const {
  auto mapping = impl_->handles[info.file]->mapping();
  impl_->bytes_read += info.nbytes;
  return {mapping.subspan(info.offset, info.nbytes), impl_};
}

std::unique_ptr<Mapping> DiskMap::map_range(const TensorInfo& info) const {
  impl_->bytes_read += info.nbytes;
  return impl_->handles.at(info.file)->map_range(info.offset, info.nbytes);
}

uint64_t DiskMap::bytes_read() const { return impl_->bytes_read; }

void DiskMap::check_mappings() const {
  for (const auto& handle : impl_->handles) handle->check_mappings();
}

std::optional<std::pair<uint32_t, uint64_t>> DiskMap::locate(const void* p, uint64_t n) const {
  const auto* byte = static_cast<const std::byte*>(p);
  for (uint32_t i = 0; i < impl_->handles.size(); ++i) {
    const auto mapping = impl_->handles[i]->mapping();
    if (byte >= mapping.data() && byte < mapping.data() + mapping.size() && n <= static_cast<uint64_t>(mapping.data() + mapping.size() - byte))
      return std::pair{i, static_cast<uint64_t>(byte - mapping.data())};
  }
  return std::nullopt;
}

void DiskMap::unmap_pages_except(std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> keep) const {
  for (uint32_t i = 0; i < impl_->handles.size(); ++i) {
    auto& ranges = keep[i];
    std::sort(ranges.begin(), ranges.end());
    impl_->handles[i]->unmap_pages_except(ranges);
  }
}

int DiskMap::descriptor(uint32_t file) const { return impl_->handles.at(file)->fd(); }

}  // namespace vramd::storage
