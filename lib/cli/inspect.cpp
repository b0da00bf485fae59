#include "cli/inspect.hpp"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>

#include "storage/disk_map.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::cli {
namespace {

using storage::DiskMap;
using storage::FileFormat;

const char* format_name(FileFormat format) {
  switch (format) {
    case FileFormat::Safetensors: return "safetensors";
    case FileFormat::TorchPickle: return "pytorch-pickle";
    case FileFormat::Gguf: return "gguf";
  }
  return "unknown";
}

struct Total {
  uint64_t tensors = 0;
  uint64_t bytes = 0;
};

// The tensors a reader sees: a DCP tensor's chunks count once.
size_t tensor_count(const DiskMap& map) {
  const auto tensors = map.tensors();
  return static_cast<size_t>(std::count_if(tensors.begin(), tensors.end(), [](const auto& t) { return !t.chunk || t.shard == 0; }));
}

std::map<std::string, Total> totals_by_dtype(const DiskMap& map) {
  std::map<std::string, Total> totals;
  for (const auto& t : map.tensors()) {
    auto& total = totals[std::string(storage::dtype_name(t.dtype))];
    if (!t.chunk || t.shard == 0) ++total.tensors;
    total.bytes += t.nbytes;
  }
  return totals;
}

void print_json(const DiskMap& map, std::ostream& out) {
  nlohmann::ordered_json doc;
  doc["checkpoint"] = map.description();
  auto& files = doc["files"] = nlohmann::ordered_json::array();
  for (const auto& file : map.files()) {
    nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
    for (const auto& [key, value] : file.metadata)  // GGUF's values are typed: JSON text already
      metadata[key] = file.format == FileFormat::Gguf ? nlohmann::ordered_json::parse(value) : nlohmann::ordered_json(value);
    files.push_back({{"path", file.path}, {"format", format_name(file.format)}, {"size", file.size},
                     {"metadata", std::move(metadata)}});
  }
  auto& tensors = doc["tensors"] = nlohmann::ordered_json::object();
  // A name several files hold (slices of one tensor): "shards", each file's entry in file order;
  // a DCP tensor: its whole shape and "chunks", each with where it lies in the whole.
  for (const auto& t : map.tensors()) {
    nlohmann::ordered_json entry = {{"dtype", storage::dtype_name(t.dtype)}, {"shape", t.shape},
                                    {"file", map.files()[t.file].path}, {"key", t.key},
                                    {"offset", t.offset}, {"nbytes", t.nbytes}};
    auto& slot = tensors[std::string(t.name())];
    if (t.chunk) {
      entry["at"] = t.chunk_offsets;
      if (t.shard == 0) slot = {{"dtype", storage::dtype_name(t.dtype)}, {"shape", t.whole}, {"key", t.key}, {"nbytes", 0}};
      slot["nbytes"] = slot["nbytes"].get<uint64_t>() + t.nbytes;
      slot["chunks"].push_back(std::move(entry));
    } else if (t.shard == 0) slot = std::move(entry);
    else if (t.shard == 1) slot = {{"shards", {std::move(slot), std::move(entry)}}};
    else slot["shards"].push_back(std::move(entry));
  }
  auto& totals = doc["totals"] = nlohmann::ordered_json::object();
  for (const auto& [dtype, total] : totals_by_dtype(map))
    totals[dtype] = {{"tensors", total.tensors}, {"bytes", total.bytes}};
  doc["total_bytes"] = map.total_bytes();
  doc["warnings"] = std::vector<std::string>(map.warnings().begin(), map.warnings().end());
  out << doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
}

// Names, paths and metadata come from the checkpoint, which may hold control bytes (a newline, a
// terminal's escape sequence): they are printed escaped, one entry a line.
void print_text(const DiskMap& map, std::ostream& out) {
  out << "checkpoint: " << escape_invalid_utf8(map.description()) << "\n\nfiles:\n";
  for (const auto& file : map.files()) {
    out << "  " << escape_invalid_utf8(file.path) << "  " << format_name(file.format) << "  " << format_bytes(file.size) << '\n';
    for (const auto& [key, value] : file.metadata)
      out << "    " << escape_invalid_utf8(key) << " = " << escape_invalid_utf8(value) << '\n';
  }
  // A DCP tensor is a line of its own, whole, then a line for each chunk: where it lies.
  const auto label = [](const storage::TensorInfo& t) {
    return t.chunk ? "  chunk at " + format_shape(t.chunk_offsets) : escape_invalid_utf8(t.name());
  };
  size_t name_width = 4, shape_width = 5;
  for (const auto& t : map.tensors()) {
    name_width = std::max({name_width, label(t).size(), t.chunk ? escape_invalid_utf8(t.name()).size() : 0});
    shape_width = std::max({shape_width, format_shape(t.shape).size(), format_shape(t.whole).size()});
  }
  const bool several_files = map.files().size() > 1;
  out << "\ntensors: " << tensor_count(map) << "\n  " << pad("NAME", name_width) << "  "
      << pad("DTYPE", 7) << "  " << pad("SHAPE", shape_width) << "  "
      << (several_files ? pad("SIZE", 11) + "  FILE" : "SIZE") << '\n';
  const auto line = [&](const std::string& name, const storage::TensorInfo& t, const std::vector<int64_t>& shape,
                        uint64_t bytes, const std::string& where) {
    out << "  " << pad(name, name_width) << "  " << pad(std::string(storage::dtype_name(t.dtype)), 7) << "  "
        << pad(format_shape(shape), shape_width) << "  " << (several_files ? pad(format_bytes(bytes), 11) + "  " + where : format_bytes(bytes))
        << '\n';
  };
  for (const auto& t : map.tensors()) {
    if (t.chunk && t.shard == 0) {
      const auto chunks = map.shards(t.name());
      uint64_t bytes = 0;
      for (const auto& chunk : chunks) bytes += chunk.nbytes;
      line(escape_invalid_utf8(t.name()), t, t.whole, bytes, counted(chunks.size(), "chunk"));
    }
    line(label(t), t, t.shape, t.nbytes, escape_invalid_utf8(map.files()[t.file].path));
  }
  out << "\ntotals:\n";
  for (const auto& [dtype, total] : totals_by_dtype(map))
    out << "  " << pad(dtype, 7) << "  " << counted(total.tensors, "tensor") << "  " << format_bytes(total.bytes) << '\n';
  out << "  " << pad("all", 7) << "  " << counted(tensor_count(map), "tensor") << "  "
      << format_bytes(map.total_bytes()) << '\n';
}

}  // namespace

void inspect(const InspectOptions& options, std::ostream& out, std::ostream& err) {
  // A model config is no checkpoint: its names, converted, are another command's.
  for (const auto& source : options.sources)
    if (source.ends_with(".toml"))
      fail(source, "is a model config, not a checkpoint: `vramctl convert " + source +
                       "` shows the tensors its converter makes, `vramctl check` checks it whole");
  auto map = DiskMap::open(options.sources, {.prefix = options.prefix, .strip_prefix = !options.keep_prefix, .shards = true});
  for (const auto& warning : map.warnings()) err << "warning: " << printable(warning) << '\n';
  if (options.json)
    print_json(map, out);
  else
    print_text(map, out);
}

}  // namespace vramd::cli
