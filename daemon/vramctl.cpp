// vramctl: the client, and offline tools that need no daemon. Built twice: vramctl, without
// LibTorch, and vramctl-torch (VRAMCTL_TORCH), which vramctl executes for the commands that need
// tensors (check, convert, plan, run).
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>

#include "cli/check.hpp"
#include "cli/convert.hpp"
#include "cli/inspect.hpp"
#include "cli/plan.hpp"
#include "cli/remote.hpp"
#include "cli/run.hpp"
#include "dist/launch.hpp"
#include "util/error.hpp"
#include "util/exit.hpp"
#include "util/utf8.hpp"
#include "util/torch_cuda.hpp"

namespace {

// Errors leave as one printable line on stderr.
int report(const char* command, const std::exception& error) {
  std::string message = error.what();
  std::replace(message.begin(), message.end(), '\n', ' ');
  const char* rank = std::getenv("RANK");  // one of a group's ranks (vramctl run --ranks, torchrun)
  const std::string who = rank && std::getenv("WORLD_SIZE") ? std::string(" (rank ") + rank + ")" : "";
  std::cerr << "vramctl " << command << who << ": " << vramd::printable(message) << '\n';
  return 1;
}

#ifndef VRAMCTL_TORCH
// The same command line, run by vramctl-torch from this executable's folder.
[[noreturn]] void run_with_torch(char** argv) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::string helper = (self.parent_path() / "vramctl-torch").string();
  ::execv(helper.c_str(), argv);
  throw vramd::Error("cannot start " + helper + " (" + std::strerror(errno) +
                     "), which runs check, convert, plan and run: it is built beside vramctl");
}
#endif

void add_daemon_config_option(CLI::App* command, std::string& path) {
  command->add_option("--daemon-config", path,
                      "Daemon config, for budgets and converter folders (default: configs/vramd.toml if present)");
}

// "vramctl --socket S list": the options given before the command, and the command line that
// puts them after it ("vramctl list --socket S"); nullopt when none comes before it.
std::optional<std::string> options_before_the_command(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] != '-') return std::nullopt;
  const std::string first = argv[1];
  if (first == "-h" || first == "--help" || first == "--version") return std::nullopt;
  for (int i = 2; i < argc; ++i) {
    for (const auto* command : app.get_subcommands([](const CLI::App*) { return true; })) {
      if (command->get_name() != argv[i]) continue;
      std::string line = std::string("vramctl ") + argv[i];
      for (int j = 1; j < argc; ++j)
        if (j != i) line += std::string(" ") + argv[j];
      return vramd::printable(line);
    }
  }
  return std::nullopt;
}

int vramctl_main(int argc, char** argv) {
  CLI::App app{"vramctl: talk to vramd, and inspect checkpoints offline"};
  app.set_version_flag("--version", std::string("vramctl ") + VRAMD_VERSION);
  app.require_subcommand(1);

  vramd::cli::InspectOptions inspect;
  auto* inspect_cmd = app.add_subcommand(
      "inspect", "Print a checkpoint's tensors (name, dtype, shape, file, size), totals and metadata");
  inspect_cmd->add_option("path", inspect.sources,
                          "safetensors file, folder, *.index.json, glob or PyTorch .bin/.pt (several allowed)")
      ->required();
  inspect_cmd->add_option("--prefix", inspect.prefix, "Only keys starting with this prefix (one model of several)");
  inspect_cmd->add_flag("--keep-prefix", inspect.keep_prefix, "Keep the prefix in the names shown");
  inspect_cmd->add_flag("--json", inspect.json, "Print one JSON object");

  vramd::cli::CheckOptions check;
  auto* check_cmd = app.add_subcommand(
      "check", "Validate model configs offline: schema, daemon budgets, converter and checkpoint index");
  check_cmd->add_option("config", check.configs, "Model config files (configs/models/NAME.toml)")->required();
  add_daemon_config_option(check_cmd, check.daemon_config);
  check_cmd->add_flag("--json", check.json, "Print one JSON object");

  vramd::cli::ConvertOptions convert;
  auto* convert_cmd = app.add_subcommand(
      "convert", "Run a model's converter over its checkpoint index, printing target keys, dtypes, shapes, expressions");
  convert_cmd->add_option("config", convert.config, "Model config file")->required();
  add_daemon_config_option(convert_cmd, convert.daemon_config);
  convert_cmd->add_flag("--json", convert.json, "Print one JSON object");
  convert_cmd->add_option("--output", convert.output, "Evaluate every target and write them to this safetensors file");

  vramd::cli::PlanOptions plan;
  auto* plan_cmd = app.add_subcommand(
      "plan", "Plan where a model's weights go across GPUs, host memory and disk under byte budgets, as accelerate would");
  plan_cmd->add_option("config", plan.config, "Model config file")->required();
  plan_cmd->add_option("--max-memory", plan.max_memory,
                       "Budgets as DEVICE=SIZE,...: cuda:N, cpu and disk (no limit when left out), e.g. cuda:0=2GiB,cpu=8GiB")
      ->required();
  plan_cmd->add_option("--dtype", plan.dtype, "Size the weights in this dtype (default: the model's computation dtype)");
  plan_cmd
      ->add_option("--strategy", plan.strategy,
                   "sequential (fill each GPU in turn), balanced (spread evenly over the GPUs) or balanced_low_0 (the "
                   "same, the first GPU as empty as the others allow), as transformers' device_map names them")
      ->check(CLI::IsMember({"sequential", "balanced", "balanced_low_0"}))
      ->capture_default_str();
  add_daemon_config_option(plan_cmd, plan.daemon_config);
  plan_cmd->add_flag("--json", plan.json, "Print one JSON object");

  vramd::cli::RunOptions run;
  auto* run_cmd = app.add_subcommand(
      "run", "Load a model from its config without a daemon, run one forward on named inputs, write the outputs");
  run_cmd->add_option("config", run.config, "Model config file")->required();
  add_daemon_config_option(run_cmd, run.daemon_config);
  run_cmd->add_option("--input,-i", run.input,
                      "safetensors file of named inputs (input_ids, attention_mask, ...); without it, only load");
  run_cmd->add_option("--output,-o", run.output, "Write the outputs to this safetensors file (else print their shapes)");
  run_cmd->add_flag("--stats", run.stats, "Print load and forward times, bytes and peak memory on stderr");
  run_cmd->add_option("--stats-json", run.stats_json, "Write the same figures as one JSON object to this file");
  run_cmd->add_option("--repeat", run.repeat, "Run the forward this many times (timings: first and median)")
      ->check(CLI::PositiveNumber);
  run_cmd->add_flag("--copy", run.copy, "Read weights into owned memory instead of mapping the checkpoint's pages");
  run_cmd->add_option("--trace", run.trace,
                      "With [vram] management: write each change of the weight bytes on the computation device "
                      "during the last forward as JSON (bench/plot_vram.py draws it)");
  run_cmd->add_option("--threads", run.threads, "Intra-op threads (default: LibTorch's; with several ranks here, the cores divided among them)")
      ->check(CLI::NonNegativeNumber);
  int ranks = 1;
  run_cmd->add_option("--ranks", ranks,
                      "Run as a group of this many processes on this machine (for a config with [partition]); "
                      "ranks started by torchrun (RANK, WORLD_SIZE, ...) need no flag")
      ->check(CLI::Range(1, 256));

  // Commands served by the daemon.
  vramd::cli::RemoteOptions remote;
  std::vector<CLI::App*> remote_cmds;
  const auto add_remote = [&](const char* name, const char* help, bool takes_model) {
    auto* command = app.add_subcommand(name, help);
    command->add_option("--socket", remote.socket, "vramd's socket (default: $VRAMD_SOCKET, else the daemon config's)");
    add_daemon_config_option(command, remote.daemon_config);
    command->add_flag("--json", remote.json, "Print the daemon's JSON answer");
    if (takes_model) command->add_option("model", remote.model, "Model name (vramctl list shows them)")->required();
    remote_cmds.push_back(command);
    return command;
  };
  add_remote("list", "List the daemon's models: state, size, where their weights are, and why one failed", false);
  add_remote("status", "Device budgets and use, and each model's residency", false);
  add_remote("health", "Whether the daemon is up", false);
  add_remote("reload", "Re-read and re-validate every model config now", false);
  auto* load_cmd = add_remote("load", "Load a model, showing progress", true);
  load_cmd->add_option("--keep-alive", remote.keep_alive, "Unload after this long unused (\"5m\", \"-1\": never)");
  bool no_progress = false, no_wait = false;  // flags that turn a default off, shown without a default
  load_cmd->add_flag("--no-progress", no_progress, "Print only the result");
  auto* unload_cmd = add_remote("unload", "Unload a model (after the requests queued before it and its leases)", true);
  auto* offload_cmd = add_remote("offload", "Put a loaded model to sleep: weights to its offload state", true);
  for (auto* command : {unload_cmd, offload_cmd})
    command->add_flag("--no-wait", no_wait, "Refuse at once (naming the holders) while the model is leased");
  auto* lease_cmd = add_remote("lease", "Take a lease of a model's weights and describe it (docs/api.md, Leases)", true);
  lease_cmd->add_option("--device", remote.device, "Where the weights are wanted: cpu or cuda:N (where the model holds them)");
  lease_cmd->add_flag("--hold", remote.hold, "Keep the lease until standard input ends");
  add_remote("onload", "Wake a sleeping model: weights back to its computation state", true);
  auto* update_cmd = add_remote("update", "Give a loaded model new values for some or all of its weights", true);
  update_cmd->add_option("checkpoint", remote.checkpoint,
                         "A checkpoint the daemon reads as the model's config reads its own (prefix, converter)")
      ->required();
  update_cmd->add_flag("--body", remote.body,
                       "Send the file's bytes instead: a safetensors file of tensors named as the model's parameters");
  auto* lora_cmd = add_remote("lora", "Put LoRA adapters in force on a loaded model without a reload (docs/models.md)", true);
  lora_cmd->add_option("adapters", remote.adapters, "FILE[:SCALE]...: PEFT folders or .safetensors files, in order (scale 1)");
  lora_cmd->add_flag("--clear", remote.clear, "Remove every adapter: the checkpoint's own weights");
  auto* forward_cmd = add_remote("forward", "Run one forward on the daemon (loads the model when needed)", true);
  forward_cmd->add_option("--input,-i", remote.input, "safetensors file of named inputs");
  forward_cmd->add_option("values", remote.values, "Inputs as name=v1,v2,... (rows separated by ';'), e.g. input_ids=101,2023,102");
  forward_cmd->add_option("--output,-o", remote.output, "Write the outputs to this safetensors file (else print them)");
  forward_cmd->add_option("--keep-alive", remote.keep_alive, "Unload after this long unused");

  if (const auto reordered = options_before_the_command(app, argc, argv)) {
    std::cerr << "vramctl: options follow the command: " << *reordered << '\n';
    return 2;
  }
  CLI11_PARSE(app, argc, argv);
  remote.progress = !no_progress;
  remote.wait = !no_wait;
  try {
    for (auto* command : remote_cmds)
      if (command->parsed()) return vramd::cli::remote(command->get_name(), remote, std::cout, std::cerr);
    if (inspect_cmd->parsed()) vramd::cli::inspect(inspect, std::cout, std::cerr);
#ifndef VRAMCTL_TORCH
    if (check_cmd->parsed() || convert_cmd->parsed() || plan_cmd->parsed() || run_cmd->parsed()) run_with_torch(argv);
#else
    if (check_cmd->parsed()) return vramd::cli::check(check, std::cout, std::cerr) ? 1 : 0;
    if (convert_cmd->parsed()) vramd::cli::convert(convert, std::cout, std::cerr);
    if (plan_cmd->parsed()) vramd::cli::plan(plan, std::cout, std::cerr);
    if (run_cmd->parsed()) {
      vramd::torch_cuda::load();  // only the command that may compute on a GPU pays for LibTorch's CUDA half
      if (ranks == 1 || std::getenv("WORLD_SIZE")) {
        vramd::cli::run(run, std::cout, std::cerr);
        return 0;
      }
      const auto group = vramd::dist::start_local_ranks(ranks, std::vector<std::string>(argv, argv + argc));
      try {
        vramd::cli::run(run, std::cout, std::cerr);
      } catch (...) {
        vramd::dist::stop_local_ranks(group);
        throw;
      }
      const auto failed = vramd::dist::wait_local_ranks(group);
      if (!failed.empty()) throw vramd::Error(failed.front());
    }
#endif
  } catch (const std::exception& error) {
    return report(app.get_subcommands().front()->get_name().c_str(), error);
  }
  return 0;
}

}  // namespace

// Ends without static destructors: LibTorch's cost the exit 0.1-0.2 s (util/exit.hpp).
int main(int argc, char** argv) { vramd::exit_without_destructors(vramctl_main(argc, argv)); }
