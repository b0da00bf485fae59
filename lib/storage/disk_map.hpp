// DiskMap: a lazy index  name -> (file, dtype, shape, byte range)  over all of a model's
// checkpoint files, built from headers alone. Reading a tensor touches only its byte range.
//
// Sources: a safetensors file, an index.json, a glob (every match), a list of these, or a folder
// read as Hugging Face reads one (its index, else model.safetensors or its only .safetensors...:
// add_folder in disk_map.cpp). PyTorch zip checkpoints are indexed lazily (storage/torch_pickle.hpp),
// GGUF files by their header (storage/gguf.hpp); a file's format is told by its first bytes. A
// folder with a .metadata is a torch.distributed.checkpoint (DCP) save, as FSDP trainers write:
// its chunks, in torch.save or safetensors form, become the shards of their names (add_dcp).
//
// A prefix restricts the map to one model inside files that hold several: only keys that
// start with it are indexed, and it is stripped from their names unless asked to be kept.
//
// The map is immutable once opened; every method may be called from several threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <map>
#include <vector>

#include "storage/dtype.hpp"
#include "storage/mapping.hpp"
#include "storage/reader.hpp"

namespace vramd::storage {

enum class FileFormat { Safetensors, TorchPickle, Gguf };

struct CheckpointFile {
  std::string path;
  FileFormat format;
  uint64_t size = 0;  // bytes on disk
  std::vector<std::pair<std::string, std::string>> metadata;
};

struct TensorInfo {
  std::string key;  // the key as stored in the file
  uint32_t prefix_length = 0;  // of the prefix stripped from the key to make its name
  DType dtype;
  std::vector<int64_t> shape;
  uint32_t file = 0;    // index into DiskMap::files()
  uint32_t shard = 0;   // which of the files that hold this name it comes from, in file order (DiskMapOptions::shards)
  uint64_t offset = 0;  // absolute byte offset of the data in that file
  uint64_t nbytes = 0;
  // A chunk of a tensor that a torch.distributed.checkpoint folder saves in pieces: where it
  // lies in the whole tensor, of shape `whole`. The map lists a name's chunks as its shards,
  // checked to tile the whole exactly; convert::whole_source joins them.
  bool chunk = false;
  std::vector<int64_t> chunk_offsets, whole;

  // The name the map serves: the key, less the prefix when it is stripped.
  std::string_view name() const { return std::string_view(key).substr(prefix_length); }
  uint64_t elements() const;
};

struct DiskMapOptions {
  std::string prefix = {};   // empty: every key
  bool strip_prefix = true;  // serve "model.x" as "x" when prefix is "model."
  // Several files may hold the same name, each a slice of one tensor (tensor-parallel shards,
  // as Meta's consolidated.NN.pth): tensors() then lists it once per file, in file order, for a
  // converter to join (src:shards). Without it, such a name is an error naming both files.
  bool shards = false;
};

class DiskMap {
 public:
  static DiskMap open(const std::vector<std::string>& sources, const DiskMapOptions& options = {});
  static DiskMap open(const std::string& source, const DiskMapOptions& options = {});

  std::span<const TensorInfo> tensors() const;  // sorted by name, then by file
  std::span<const CheckpointFile> files() const;
  std::span<const std::string> warnings() const;  // e.g. shard tensors an index leaves out
  const std::string& description() const;         // the sources, for messages

  // The tensor of that name; with shards, the first file's.
  const TensorInfo* find(std::string_view name) const;
  // Each file's tensor of that name, in file order; empty when there is none.
  std::span<const TensorInfo> shards(std::string_view name) const;
  // Throws Error naming the key and sources.
  const TensorInfo& at(std::string_view name, uint32_t shard = 0) const;

  uint64_t total_bytes() const;  // of the tensors in the map

  // Copies exactly the tensor's bytes into dst (dst.size() == info.nbytes).
  void read(const TensorInfo& info, std::span<std::byte> dst) const;
  // The same, bypassing the page cache where the file system allows it.
  void read_direct(const TensorInfo& info, std::span<std::byte> dst) const;
  // Bytes [offset, offset + dst.size()) of one of files(), in reads of up to 8 MiB of which
  // several are in flight (storage::read_ranges), with O_DIRECT when `direct`.
  void read_file(uint32_t file, std::span<std::byte> dst, uint64_t offset, bool direct) const;
  // Many such ranges at once, several reads in flight: storage::read_ranges.
  struct Range {
    uint32_t file;
    uint64_t offset;
    std::span<std::byte> dst;
  };
  void read_ranges(std::span<const Range> ranges, const ReaderOptions& options) const;
  // Ranges of files() read through the pool's buffers: storage::read_staged.
  struct Staged {
    uint32_t file;
    uint64_t offset;
    uint64_t size;
  };
  void read_staged(std::span<const Staged> ranges, StagingPool& pool, const ReaderOptions& options) const;
  // The tensor's bytes in place, in a private mapping of its file, and an owner that keeps
  // them valid for as long as it lives.
  std::pair<std::span<std::byte>, std::shared_ptr<void>> bytes(const TensorInfo& info) const;
  // The tensor's bytes in a read-only mapping of their own, as File::map_range.
  std::unique_ptr<Mapping> map_range(const TensorInfo& info) const;
  // Throws MappingLost naming the first file a mapping of which lost pages (File::check_mappings):
  // what was read through bytes() or map_range() since may hold zeros, not the file's bytes.
  void check_mappings() const;
  // Where bytes [p, p + n) lie in the private mapping bytes() hands out: the file and the
  // offset in it; nullopt when they lie elsewhere.
  std::optional<std::pair<uint32_t, uint64_t>> locate(const void* p, uint64_t n) const;
  // File::unmap_pages_except for each file mapped: `keep` holds, by file index, the byte ranges
  // to keep mapped (in any order).
  void unmap_pages_except(std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> keep) const;
  // The read-only descriptor of files()[file], valid while the map lives.
  int descriptor(uint32_t file) const;
  // Bytes of tensor data asked of the files so far, by reads and mappings alike (a mapping
  // counts whole, touched or not): what this process read of the checkpoint, where the page
  // cache, shared with other processes, cannot say.
  uint64_t bytes_read() const;

  struct Impl;

 private:
  explicit DiskMap(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace vramd::storage
