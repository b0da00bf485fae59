// vramd: the daemon. Serves the models in its config folder over a Unix socket (docs/api.md)
// until SIGTERM or SIGINT. `--check` validates the config and the model folder and exits.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <optional>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "dist/commands.hpp"
#include "dist/group.hpp"
#include "dist/launch.hpp"
#include "load/dry_run.hpp"
#include "server/daemon.hpp"
#include "server/http.hpp"
#include "server/runtime.hpp"
#include "util/error.hpp"
#include "util/exit.hpp"
#include "util/format.hpp"
#include "util/log.hpp"
#include "util/torch_cuda.hpp"
#include "util/utf8.hpp"
#include "weights/holdings.hpp"

namespace fs = std::filesystem;

namespace {

// The socket's folder as startup would take it, then every model config in the folder through
// the whole load short of reading data; each model a row, its problems beneath it.
int check(const vramd::config::DaemonConfig& config) {
  int invalid = 0;
  std::vector<std::vector<std::string>> rows;
  std::vector<std::vector<std::string>> problems;
  try {
    vramd::server::check_socket_folder(config.socket, /*make=*/false);
  } catch (const std::exception& error) {
    ++invalid;
    rows.push_back({"invalid", "socket", vramd::escape_invalid_utf8(config.socket)});
    problems.push_back({error.what()});
  }
  std::vector<fs::path> files;
  std::error_code ec;
  for (fs::directory_iterator it(config.models, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".toml") files.push_back(it->path());
  std::sort(files.begin(), files.end());
  const std::string folder = vramd::escape_invalid_utf8(config.models);
  if (ec) std::cout << "cannot read the model folder " << folder << ": " << ec.message() << '\n';
  if (!ec && files.empty()) std::cout << "no model configs (*.toml) in " << folder << '\n';
  for (const auto& file : files) {
    const std::string path = "(" + vramd::escape_invalid_utf8(file.string()) + ")";
    try {
      auto model = vramd::config::load_model_config(file.string(), config);
      auto dry = vramd::load::dry_run(model);
      vramd::weights::check_budgets(model, dry, config);
      rows.push_back({"valid", model.name,
                      dry.architecture + ", " + dry.dtype + ", " + vramd::format_bytes(dry.report.bytes) + " in " +
                          vramd::counted(dry.report.tensors, "tensor"),
                      path});
      problems.emplace_back();
    } catch (const std::exception& error) {
      ++invalid;
      rows.push_back({"invalid", vramd::escape_invalid_utf8(file.stem().string()), "", path});
      problems.push_back(vramd::split_lines(error.what()));
    }
  }
  const auto lines = vramd::split_lines(vramd::format_table(rows));
  for (size_t i = 0; i < rows.size(); ++i) {
    std::cout << lines[i] << '\n';
    for (const auto& line : problems[i]) std::cout << "         " << vramd::printable(line) << '\n';
  }
  return invalid ? 1 : 0;
}

int vramd_main(int argc, char** argv) {
  CLI::App app{"vramd: keeps PyTorch models ready to run"};
  app.set_version_flag("--version", std::string("vramd ") + VRAMD_VERSION);
  std::string config_path = "configs/vramd.toml", socket;
  bool check_only = false;
  app.add_option("-c,--config", config_path, "Daemon config file")->capture_default_str();
  app.add_option("--socket", socket, "Unix socket to serve on (overrides the config)");
  app.add_flag("--check", check_only, "Validate the config and every model config, then exit");
  CLI11_PARSE(app, argc, argv);

  try {
    auto config = vramd::config::load_daemon_config(config_path);
    if (!socket.empty()) config.socket = fs::absolute(socket).string();
    if (check_only) return check(config);
    vramd::torch_cuda::load();  // before any LibTorch call and any thread
    // A group for models with [partition]: from torchrun's variables, else [group] world_size
    // ranks started here, which are started again when they exit. Rank 0 serves; the others do
    // what it sends them.
    auto group_options = vramd::dist::options_from_environment(config);
    std::optional<vramd::dist::LocalRankSupervisor> local;
    if (!group_options && config.world_size > 1) {
      local.emplace(vramd::dist::start_local_ranks(config.world_size, std::vector<std::string>(argv, argv + argc)),
                    [](const std::string& line) { vramd::log::warn(line); });
      group_options = vramd::dist::options_from_environment(config);
    }
    if (!group_options || group_options->world_size == 1) return vramd::server::serve(config);
    auto group = vramd::dist::Group::join(*group_options);
    vramd::log::info(group->describe_address());
    if (group->rank() > 0) return vramd::server::Runtime::follow(config, group);
    if (local) local->set_rejoin_value([group] { return std::to_string(vramd::dist::next_command(*group)); });
    vramd::server::Runtime::use_group(group);
    const int status = vramd::server::serve(config);
    vramd::server::Runtime::use_group(nullptr);
    local.reset();  // stops the ranks
    return status;
  } catch (const std::exception& error) {  // a vramd::Error, or a fault of our own: said, not a crash
    for (const auto& line : vramd::split_lines(error.what())) std::cerr << "vramd: " << vramd::printable(line) << '\n';
    return 1;
  }
}

}  // namespace

// Ends without static destructors: LibTorch's cost the exit 0.1-0.2 s (util/exit.hpp).
int main(int argc, char** argv) { vramd::exit_without_destructors(vramd_main(argc, argv)); }
