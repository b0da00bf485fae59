// vramd: the daemon. Until its event loop and socket land (issue #6) it reads its config,
// validates the model configs in its folder (the whole load short of reading data), loads the
// models marked preload, prints what it would serve, and exits.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <iomanip>
#include <iostream>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "config/units.hpp"
#include "model/loader.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  CLI::App app{"vramd: keeps PyTorch models ready to run"};
  app.set_version_flag("--version", std::string("vramd ") + VRAMD_VERSION);
  std::string config_path = "configs/vramd.toml";
  app.add_option("-c,--config", config_path, "Daemon config file")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  vramd::config::DaemonConfig config;
  try {
    config = vramd::config::load_daemon_config(config_path);
  } catch (const vramd::Error& error) {
    std::cerr << "vramd: " << error.what() << '\n';
    return 1;
  }
  std::cout << "vramd " << VRAMD_VERSION << "\nconfig     " << config.path << "\nsocket     " << config.socket
            << "\nmodels     " << config.models << "\nkeep_alive " << vramd::config::format_duration(config.keep_alive)
            << "\nbudgets   ";
  for (const auto& [device, bytes] : config.budgets) std::cout << " " << device << "=" << vramd::format_bytes(bytes);
  std::cout << "\n\n";

  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(config.models, ec))
    if (entry.path().extension() == ".toml") files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  if (ec) std::cout << "cannot read the model folder " << config.models << ": " << ec.message() << '\n';
  if (!ec && files.empty()) std::cout << "no model configs (*.toml) in " << config.models << '\n';
  for (const auto& file : files) {
    try {
      auto model = vramd::config::load_model_config(file.string(), config);
      auto dry = vramd::model::dry_run(model);
      std::cout << "valid    " << model.name << "  " << dry.architecture << ", " << dry.dtype << ", "
                << vramd::format_bytes(dry.report.bytes) << " in " << dry.report.tensors << " tensors  ("
                << file.string() << ")\n";
      if (!model.residency.preload) continue;
      auto loaded = vramd::model::load_model(model);
      std::cout << "ready    " << model.name << "  loaded on " << model.vram.computation.device << " in "
                << std::fixed << std::setprecision(1) << (loaded.report.plan_seconds + loaded.report.load_seconds) * 1e3 << " ms\n"
                << std::defaultfloat;
    } catch (const vramd::Error& error) {
      std::cout << "invalid  " << file.string() << "\n";
      for (const auto& line : vramd::split_lines(error.what())) std::cout << "         " << line << '\n';
    }
  }
  std::cout << "\nThe event loop and socket are not built yet (issue #6): nothing is served. Until then,\n"
               "run a model with: vramctl run CONFIG.toml --input IN.safetensors --output OUT.safetensors\n";
  return 0;
}
