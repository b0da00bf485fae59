#include "cli/inspect.hpp"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>

#include "storage/disk_map.hpp"
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

std::map<std::string, Total> totals_by_dtype(const DiskMap& map) {
  std::map<std::string, Total> totals;
  for (const auto& t : map.tensors()) {
    auto& total = totals[std::string(storage::dtype_name(t.dtype))];
    ++total.tensors;
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
  // A name several files hold (slices of one tensor): "shards", each file's entry in file order.
  for (const auto& t : map.tensors()) {
    nlohmann::ordered_json entry = {{"dtype", storage::dtype_name(t.dtype)}, {"shape", t.shape},
                                    {"file", map.files()[t.file].path}, {"key", t.key},
                                    {"offset", t.offset}, {"nbytes", t.nbytes}};
    auto& slot = tensors[std::string(t.name())];
    if (t.shard == 0) slot = std::move(entry);
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
  size_t name_width = 4, shape_width = 5;
  for (const auto& t : map.tensors()) {
    name_width = std::max(name_width, escape_invalid_utf8(t.name()).size());
    shape_width = std::max(shape_width, format_shape(t.shape).size());
  }
  const bool several_files = map.files().size() > 1;
  out << "\ntensors: " << map.tensors().size() << "\n  " << pad("NAME", name_width) << "  "
      << pad("DTYPE", 7) << "  " << pad("SHAPE", shape_width) << "  "
      << (several_files ? pad("SIZE", 11) + "  FILE" : "SIZE") << '\n';
  for (const auto& t : map.tensors()) {
    out << "  " << pad(escape_invalid_utf8(t.name()), name_width) << "  " << pad(std::string(storage::dtype_name(t.dtype)), 7)
        << "  " << pad(format_shape(t.shape), shape_width) << "  ";
    if (several_files)
      out << pad(format_bytes(t.nbytes), 11) << "  " << escape_invalid_utf8(map.files()[t.file].path);
    else
      out << format_bytes(t.nbytes);
    out << '\n';
  }
  out << "\ntotals:\n";
  for (const auto& [dtype, total] : totals_by_dtype(map))
    out << "  " << pad(dtype, 7) << "  " << counted(total.tensors, "tensor") << "  " << format_bytes(total.bytes) << '\n';
  out << "  " << pad("all", 7) << "  " << counted(map.tensors().size(), "tensor") << "  "
      << format_bytes(map.total_bytes()) << '\n';
}

}  // namespace

void inspect(const InspectOptions& options, std::ostream& out, std::ostream& err) {
  auto map = DiskMap::open(options.sources, {.prefix = options.prefix, .strip_prefix = !options.keep_prefix, .shards = true});
  for (const auto& warning : map.warnings()) err << "warning: " << printable(warning) << '\n';
  if (options.json)
    print_json(map, out);
  else
    print_text(map, out);
}

}  // namespace vramd::cli
