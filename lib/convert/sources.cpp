#include "convert/sources.hpp"

#include <map>
#include <vector>

#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::convert {

ExprPtr source_of(const storage::TensorInfo& info, uint32_t shards) {
  const auto dtype = storage::dtype_block(info.dtype) == 1 ? info.dtype : storage::DType::F32;
  return source(std::string(info.name()), dtype, info.shape, info.shard, shards);
}

bool sharded_at(std::span<const storage::TensorInfo> tensors, size_t i) {
  return !tensors[i].chunk && i + 1 < tensors.size() && tensors[i + 1].shard > 0 &&
         tensors[i + 1].name() == tensors[i].name();
}

bool later_chunk(const storage::TensorInfo& info) { return info.chunk && info.shard > 0; }

namespace {

// Chunks that tile a box joined into it: split along the first dimension from `dim` on in
// which they lie at several offsets, each slab joined along the next, then cat. The chunks of
// DTensor placements (FSDP's rows, tensor parallelism's columns) form such a grid.
ExprPtr join_chunks(std::vector<const storage::TensorInfo*> chunks, size_t dim, uint32_t count) {
  if (chunks.size() == 1) return source_of(*chunks[0], count);
  const size_t rank = chunks[0]->shape.size();
  for (; dim < rank; ++dim) {
    std::map<int64_t, std::vector<const storage::TensorInfo*>> slabs;
    for (const auto* chunk : chunks) slabs[chunk->chunk_offsets[dim]].push_back(chunk);
    if (slabs.size() == 1) continue;
    std::vector<ExprPtr> parts;
    for (auto& [offset, slab] : slabs) {
      for (const auto* chunk : slab)
        if (chunk->shape[dim] != slab[0]->shape[dim])
          throw Error("the chunks of " + quote(chunk->name()) + " do not form a grid (at offset " +
                      std::to_string(offset) + " of dimension " + std::to_string(dim) + " they are " +
                      std::to_string(slab[0]->shape[dim]) + " and " + std::to_string(chunk->shape[dim]) +
                      " long); vramd joins grids only");
      parts.push_back(join_chunks(std::move(slab), dim + 1, count));
    }
    return cat(parts, static_cast<int64_t>(dim));
  }
  throw Error("the chunks of " + quote(chunks[0]->name()) + " lie at one place");  // DiskMap refuses overlaps
}

}  // namespace

ExprPtr whole_source(const storage::DiskMap& map, const storage::TensorInfo& info) {
  if (!info.chunk) return source_of(info);
  const auto chunks = map.shards(info.name());
  std::vector<const storage::TensorInfo*> all;
  for (const auto& chunk : chunks) all.push_back(&chunk);
  return join_chunks(std::move(all), 0, static_cast<uint32_t>(chunks.size()));
}

}  // namespace vramd::convert
