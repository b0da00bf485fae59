// vramd: the daemon. Until its event loop lands (issue #6) it validates that its config file
// parses and prints what it would serve with.
#include <CLI/CLI.hpp>
#include <toml++/toml.h>

#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"vramd: keeps PyTorch models ready to run"};
  app.set_version_flag("--version", std::string("vramd ") + VRAMD_VERSION);
  std::string config_path = "configs/vramd.toml";
  app.add_option("-c,--config", config_path, "Daemon config file")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    toml::table config = toml::parse_file(config_path);
    std::cout << "vramd " << VRAMD_VERSION << "\nconfig " << config_path << ":\n" << config << "\n\n"
              << "The daemon's event loop and socket are not built yet (issue #6); nothing is served.\n";
  } catch (const toml::parse_error& error) {
    const auto& where = error.source().begin;
    std::cerr << "vramd: " << config_path << ":" << where.line << ":" << where.column << ": "
              << error.description() << '\n';
    return 1;
  }
  return 0;
}
