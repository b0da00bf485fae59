// Which files a checkpoint names, before any is read: a file, a folder (its *.safetensors.index.json,
// its shards, a torch.save file, Meta's consolidated.NN.pth slices, a DCP folder's .metadata), an
// index.json, a glob, or a list of them. For storage/disk_map.cpp, which indexes each part.
#pragma once

#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vramd::storage {

bool ends_with(std::string_view text, std::string_view suffix);
// A torch.save file's name (.bin, .pt, .pth, .ckpt).
bool is_pickle_name(std::string_view name);

// A torch.distributed.checkpoint folder's index of its chunks.
inline constexpr const char* kDcpMetadata = ".metadata";

// One checkpoint file to index; `only` restricts it to the keys an index.json assigns to it.
struct Part {
  std::string path;
  std::string index;  // the index.json that named this shard, if any
  std::optional<std::set<std::string>> only;
  bool dcp = false;  // path is a DCP folder's .metadata
};

// Every file the sources name, in order, with the warnings about files a folder leaves out.
// Throws Error naming a source that does not exist, a glob that matches nothing, a folder with
// no checkpoint, and an index.json that names a shard twice or none at all.
std::vector<Part> checkpoint_parts(std::span<const std::string> sources, std::vector<std::string>& warnings);

}  // namespace vramd::storage
