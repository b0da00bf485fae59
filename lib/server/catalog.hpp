// The model folder as the daemon reads it: every *.toml file in it, read (regular files of at
// most 1 MiB, util/file.hpp) and validated (the config, then the dry run of its load: index,
// converter, architecture, names and the weights' plan). Runs on the validator thread, never on
// the loop: a file may be slow, or not a file at all. The registry then compares what it got
// with what it serves (Registry::apply).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "load/dry_run.hpp"

namespace vramd::server {

// One config file as last read.
struct ConfigFile {
  std::string file;
  bool exists = true;
  std::string text;
  std::optional<config::ModelConfig> config;  // with `dry`, when it is valid
  std::optional<model::DryRun> dry;
  std::string error;  // why it is not

  static ConfigFile gone(const std::string& file);
};

using ConfigTexts = std::map<std::string, std::string>;  // file -> the content last seen

// Lists `daemon.models` and validates its configs: every file whose content differs from
// `known` (all of them unless `skip_unchanged`), and a `gone` entry for each file of `known`
// no longer there. An unreadable folder is logged and gives nothing.
std::vector<ConfigFile> examine_folder(const config::DaemonConfig& daemon, const ConfigTexts& known, bool skip_unchanged);

}  // namespace vramd::server
