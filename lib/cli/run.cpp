#include "cli/run.hpp"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <sys/resource.h>

#include <chrono>
#include <ostream>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "model/loader.hpp"
#include "storage/disk_map.hpp"
#include "storage/tensor_io.hpp"
#include "util/format.hpp"

namespace vramd::cli {
namespace {

uint64_t peak_rss() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;
}

storage::NamedTensors read_inputs(const std::string& path) {
  const auto map = storage::DiskMap::open(path);
  storage::NamedTensors inputs;
  for (const auto& info : map.tensors())
    inputs.emplace_back(std::string(info.name()), storage::load_tensor(map, info, {.mode = storage::ReadMode::Copy}));
  return inputs;
}

}  // namespace

void run(const RunOptions& options, std::ostream& out, std::ostream& err) {
  if (options.threads > 0) at::set_num_threads(options.threads);
  const auto config = config::load_model_config(options.config, config::find_daemon_config(options.daemon_config));
  const storage::NamedTensors inputs = options.input.empty() ? storage::NamedTensors{} : read_inputs(options.input);

  const uint64_t rss_before = peak_rss();
  auto [model, report] = model::load_model(config);
  const uint64_t rss_loaded = peak_rss();
  for (const auto& warning : report.warnings) err << "warning: " << warning << '\n';
  for (const auto& line : report.printed) err << "print: " << line << '\n';
  for (const auto& name : report.missing) err << "warning: missing from the checkpoint (strict = false; the parameter stays empty): " << name << '\n';
  for (const auto& name : report.unexpected) err << "warning: unexpected checkpoint tensor (not used): " << name << '\n';
  if (options.stats)
    err << "loaded " << config.name << " (" << model->architecture() << ", " << c10::toString(model->dtype()) << ", "
        << model->device() << "): " << report.tensors << " tensors, " << format_bytes(report.bytes) << " ("
        << report.zero_copy << " mapped without a copy); plan " << report.plan_seconds * 1e3 << " ms, load "
        << report.load_seconds * 1e3 << " ms; peak RSS " << format_bytes(rss_loaded) << " (+"
        << format_bytes(rss_loaded - rss_before) << " while loading; largest tensor " << format_bytes(report.largest)
        << ")\n";
  if (options.input.empty()) return;

  const auto start = std::chrono::steady_clock::now();
  storage::NamedTensors outputs;
  {
    c10::InferenceMode inference;
    try {
      outputs = model->forward(inputs);
    } catch (const c10::Error& e) {
      throw Error(config.path + ": forward failed: " + e.what_without_backtrace());
    } catch (const Error& e) {
      fail(options.input, e.what());
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (options.stats)
    err << "forward " << seconds * 1e3 << " ms; peak RSS " << format_bytes(peak_rss()) << '\n';

  if (!options.output.empty()) {
    storage::save_tensors(options.output, outputs, {{"model", config.name}, {"produced_by", "vramd"}});
    return;
  }
  for (const auto& [name, tensor] : outputs)
    out << name << ' ' << c10::toString(tensor.scalar_type()) << ' ' << format_shape(tensor.sizes().vec()) << '\n';
}

}  // namespace vramd::cli
