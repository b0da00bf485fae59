#include "storage/checkpoint_parts.hpp"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::storage {
namespace fs = std::filesystem;

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

bool is_pickle_name(std::string_view name) {
  return ends_with(name, ".bin") || ends_with(name, ".pt") || ends_with(name, ".pth") ||
         ends_with(name, ".ckpt");
}

namespace {

bool is_glob(std::string_view source) { return source.find_first_of("*?[") != std::string_view::npos; }

std::vector<std::string> sorted_matches(const fs::path& folder, std::string_view suffix) {
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(folder)) {
    std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && ends_with(name, suffix)) found.push_back(entry.path().string());
  }
  std::sort(found.begin(), found.end());
  return found;
}

void add_index(const std::string& index_path, std::vector<Part>& parts) {
  std::ifstream stream(index_path);
  if (!stream) fail(index_path, "cannot open");
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(stream);
  } catch (const nlohmann::json::exception& e) {
    fail(index_path, "not valid JSON: " + escape_invalid_utf8(e.what()));
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    fail(index_path, "has no \"weight_map\" object");
  std::map<std::string, std::set<std::string>> by_shard;
  std::vector<std::string> order;
  for (const auto& [key, value] : index["weight_map"].items()) {
    if (!value.is_string()) fail(index_path, "weight_map entry " + quote(key) + " is not a file name");
    std::string shard = value.get<std::string>();
    fs::path relative(shard);
    if (relative.is_absolute() || shard.empty() ||
        std::any_of(relative.begin(), relative.end(), [](const fs::path& p) { return p == ".."; }))
      fail(index_path, "weight_map entry " + quote(key) + " names " + quote(shard) +
                           ", which is not a file beside the index");
    if (!by_shard.count(shard)) order.push_back(shard);
    by_shard[shard].insert(key);
  }
  const fs::path folder = fs::path(index_path).parent_path();
  for (const auto& shard : order) {
    std::string path = (folder / shard).string();
    if (!fs::exists(path))
      fail(index_path, "names the shard " + quote(shard) + " (for " +
                           std::to_string(by_shard[shard].size()) + " keys), which does not exist");
    parts.push_back(Part{path, index_path, std::move(by_shard[shard])});
  }
}

// Meta's tensor-parallel files: consolidated.00.pth, consolidated.01.pth, ...
bool is_meta_shard(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  return name.size() == 19 && name.starts_with("consolidated.") && ends_with(name, ".pth") &&
         std::isdigit(static_cast<unsigned char>(name[13])) && std::isdigit(static_cast<unsigned char>(name[14]));
}

// A folder's checkpoint as Hugging Face finds it: the index of its shards, else the one file
// named as the libraries save it (model.safetensors, diffusion_pytorch_model.safetensors,
// pytorch_model.bin), else the folder's only checkpoint file; Meta's consolidated.NN.pth files
// are taken together, as transformers' conversion takes them. Other checkpoint files beside the
// one chosen are left out with a warning; several and none chosen is an error saying how to
// name them.
void add_folder(const std::string& folder, std::vector<Part>& parts, std::vector<std::string>& warnings) {
  if (fs::is_regular_file(fs::path(folder) / kDcpMetadata)) {
    parts.push_back(Part{(fs::path(folder) / kDcpMetadata).string(), {}, std::nullopt, true});
    return;
  }
  const auto index = [&](const char* suffix) {
    auto indexes = sorted_matches(folder, suffix);
    if (indexes.size() > 1)
      fail(folder, "holds several index files (" + indexes[0] + ", " + indexes[1] + "); name the one to load");
    if (indexes.size() == 1) add_index(indexes[0], parts);
    return indexes.size() == 1;
  };
  const auto pick = [&](std::vector<std::string> files, std::initializer_list<const char*> known) {
    if (files.empty()) return false;
    // All of them: checkpoint = "<folder>/*.pth" for consolidated.00.pth and .01.pth, a list
    // when their extensions differ.
    const auto extension = fs::path(files[0]).extension();
    std::string all = "\"" + (fs::path(folder) / ("*" + extension.string())).string() + "\"";
    if (std::any_of(files.begin(), files.end(), [&](const auto& file) { return fs::path(file).extension() != extension; })) {
      all.clear();
      for (const auto& file : files) all += (all.empty() ? "[\"" : ", \"") + file + "\"";
      all += "]";
    }
    if (files.size() > 1 && std::all_of(files.begin(), files.end(), is_meta_shard)) {
      for (const auto& file : files) parts.push_back(Part{file, {}, std::nullopt});
      return true;
    }
    std::string chosen = files.size() == 1 ? files[0] : "";
    for (const char* name : known)
      if (chosen.empty() && std::find(files.begin(), files.end(), (fs::path(folder) / name).string()) != files.end())
        chosen = (fs::path(folder) / name).string();
    std::string others;
    for (const auto& file : files)
      if (file != chosen) others += (others.empty() ? "" : ", ") + fs::path(file).filename().string();
    if (chosen.empty())
      fail(folder, "holds " + std::to_string(files.size()) + " checkpoint files (" + others + ") and neither an index " +
                       "naming its shards nor a file named as Hugging Face saves one (" + *known.begin() +
                       "); name the file to load, or load them together with checkpoint = " + all);
    if (!others.empty())
      warnings.push_back(folder + ": loading " + fs::path(chosen).filename().string() + " as Hugging Face would; " +
                         others + " beside it left out (checkpoint = " + all + " loads them all)");
    parts.push_back(Part{chosen, {}, std::nullopt});
    return true;
  };
  if (index(".safetensors.index.json") ||
      pick(sorted_matches(folder, ".safetensors"), {"model.safetensors", "diffusion_pytorch_model.safetensors"}) ||
      index(".bin.index.json"))
    return;
  std::vector<std::string> pickles;
  for (const char* suffix : {".bin", ".pt", ".pth", ".ckpt"})
    for (auto& path : sorted_matches(folder, suffix)) pickles.push_back(std::move(path));
  std::sort(pickles.begin(), pickles.end());
  if (!pick(pickles, {"pytorch_model.bin", "diffusion_pytorch_model.bin"}) &&
      !pick(sorted_matches(folder, ".gguf"), {"model.gguf"}))
    fail(folder, "holds no checkpoint (looked for *.safetensors.index.json, *.bin.index.json, *.safetensors, "
                 "*.bin, *.pt, *.pth, *.ckpt, *.gguf)");
}

void add_source(const std::string& source, std::vector<Part>& parts, std::vector<std::string>& warnings) {
  if (is_glob(source)) {
    glob_t matches{};
    int status = ::glob(source.c_str(), 0, nullptr, &matches);
    std::vector<std::string> paths(matches.gl_pathv, matches.gl_pathv + matches.gl_pathc);
    ::globfree(&matches);
    if (status != 0 || paths.empty()) fail(source, "no file matches this pattern");
    for (const auto& path : paths) add_source(path, parts, warnings);
    return;
  }
  std::error_code ec;
  auto status = fs::status(source, ec);
  if (ec || !fs::exists(status)) fail(source, "no such file or folder");
  if (fs::is_directory(status)) return add_folder(source, parts, warnings);
  if (ends_with(source, ".index.json")) return add_index(source, parts);
  parts.push_back(Part{source, {}, std::nullopt, fs::path(source).filename() == kDcpMetadata});
}

}  // namespace

std::vector<Part> checkpoint_parts(std::span<const std::string> sources, std::vector<std::string>& warnings) {
  std::vector<Part> parts;
  for (const auto& source : sources) add_source(source, parts, warnings);
  return parts;
}

}  // namespace vramd::storage
