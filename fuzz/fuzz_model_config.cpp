// libFuzzer target: the daemon reads every TOML file dropped into its models folder, so any text
// there becomes a ModelConfig whose limits fit the daemon's budgets (the two on one device
// together) and whose [arch] table is valid JSON, or one vramd::Error whose every line is valid
// UTF-8 and names the file; nothing else may happen (no other exception, no crash).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "config/model_config.hpp"
#include "refusal.hpp"
#include "util/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const vramd::config::DaemonConfig daemon = [] {
    vramd::config::DaemonConfig config;  // folders that hold nothing: no script or family is found
    config.models = "/nonexistent/vramd-fuzz/models";
    config.converters = {"/nonexistent/vramd-fuzz/converters"};
    config.architectures = {"/nonexistent/vramd-fuzz/architectures"};
    config.budgets = {{"cpu", 8ull << 30}, {"cuda:0", 80ull << 30}};
    return config;
  }();
  static const std::string path = daemon.models + "/fuzz.toml";
  try {
    const auto config = vramd::config::load_model_config(path, std::string(reinterpret_cast<const char*>(data), size), daemon);
    if (config.name.empty() || !nlohmann::json::accept(config.arch_json)) std::abort();
    const auto budget = [](const vramd::config::Device& device) {
      const auto found = daemon.budgets.find(device.str());
      if (found == daemon.budgets.end()) std::abort();  // a limit where there is no budget
      return found->second;
    };
    const auto& vram = config.vram;
    if (vram.limit && *vram.limit > budget(vram.computation.device)) std::abort();
    if (vram.onload_limit) {
      const bool shared = vram.onload.device == vram.computation.device && vram.limit;
      if (static_cast<unsigned __int128>(*vram.onload_limit) + (shared ? *vram.limit : 0) > budget(vram.onload.device))
        std::abort();
    }
  } catch (const vramd::Error& e) {
    if (!names_the_file_on_every_line(e.what(), path)) std::abort();
  }
  return 0;
}
