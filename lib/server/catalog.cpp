#include "server/catalog.hpp"

#include <filesystem>
#include <set>

#include "util/error.hpp"
#include "util/file.hpp"
#include "util/log.hpp"
#include "util/utf8.hpp"
#include "weights/holdings.hpp"

namespace vramd::server {
namespace fs = std::filesystem;

ConfigFile ConfigFile::gone(const std::string& file) {
  ConfigFile v;
  v.file = file;
  v.exists = false;
  return v;
}

std::vector<ConfigFile> examine_folder(const config::DaemonConfig& daemon, const ConfigTexts& known, bool skip_unchanged) {
  std::error_code ec;
  std::set<std::string> files;
  for (fs::directory_iterator it(daemon.models, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".toml") files.insert(it->path().string());
  if (ec) {
    log::warn("cannot read the model folder " + escape_invalid_utf8(daemon.models) + ": " + ec.message());
    return {};
  }
  std::vector<ConfigFile> out;
  for (const auto& [file, text] : known)
    if (!files.count(file)) out.push_back(ConfigFile::gone(file));
  for (const auto& file : files) {
    ConfigFile v;
    v.file = file;
    try {
      v.text = read_regular_file(file, kMaxConfigBytes);
    } catch (const Error& e) {
      v.exists = fs::exists(fs::symlink_status(file, ec));  // a link to nowhere is there, and invalid
      v.error = e.what();
      out.push_back(std::move(v));
      continue;
    }
    if (const auto it = known.find(file); skip_unchanged && it != known.end() && it->second == v.text) continue;
    try {
      auto config = config::load_model_config(file, v.text, daemon);
      auto dry = load::dry_run(config);
      weights::check_budgets(config, dry, daemon);  // it could never load
      v.dry = std::move(dry);
      v.config = std::move(config);
    } catch (const std::exception& e) {
      v.error = e.what();
    }
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace vramd::server
