#include "cli/run.hpp"

#include <ATen/Parallel.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "convert/expr.hpp"
#include "dist/group.hpp"
#include "dist/launch.hpp"
#include "model/allocations.hpp"
#include "load/loader.hpp"
#include "storage/disk_map.hpp"
#include "storage/tensor_io.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"
#include "weights/source.hpp"
#include "weights/weights.hpp"

namespace vramd::cli {
namespace {

// The process's peak resident memory (VmHWM). Unlike getrusage's ru_maxrss it starts afresh at
// exec, so it does not include the memory of the process that started vramctl.
uint64_t status_bytes(const char* key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.starts_with(key)) return std::stoull(line.substr(std::strlen(key))) * 1024;
  return 0;
}

uint64_t peak_rss() { return status_bytes("VmHWM:"); }
uint64_t rss() { return status_bytes("VmRSS:"); }

storage::NamedTensors read_inputs(const std::string& path) {
  const auto map = storage::DiskMap::open(path);
  storage::NamedTensors inputs;
  for (const auto& info : map.tensors())
    inputs.emplace_back(std::string(info.name()), storage::load_tensor(map, info, {.dtype = std::nullopt, .mode = storage::ReadMode::Copy}));
  return inputs;
}

std::string ms(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f ms", seconds * 1e3);
  return text;
}

// Every rank's peak memory and weight bytes, gathered to all of them.

}  // namespace

void run(const RunOptions& options, std::ostream& out, std::ostream& err) {
  if (options.threads > 0) at::set_num_threads(options.threads);
  else if (const int threads = dist::threads_per_local_rank()) at::set_num_threads(threads);
  const auto daemon = config::find_daemon_config(options.daemon_config);
  const auto config = config::load_model_config(options.config, daemon);
  const storage::NamedTensors inputs = options.input.empty() ? storage::NamedTensors{} : read_inputs(options.input);

  const bool counting = model::count_cpu_allocations();
  const uint64_t rss_before = peak_rss();
  model::LoadOptions load_options;
  load_options.zero_copy = !options.copy;
  if (auto group = dist::options_from_environment(daemon); group && group->world_size > 1) {
    // The model's timeout bounds reaching the store as it bounds every step after.
    if (config.partition.world_size > 1) group->timeout = config.partition.timeout;
    load_options.group = dist::Group::join(*group);
    err << "vramctl run: " << load_options.group->describe_address() << '\n';
    load_options.partition_name = "run/" + config.name;
  }
  auto loaded = load::load_model(config, load_options);
  auto& model = loaded.model;
  auto& report = loaded.report;
  const uint64_t rss_loaded = peak_rss();
  // Of a group, only rank 0 prints and writes; every rank runs the same forwards.
  const bool lead = !load_options.group || load_options.group->rank() == 0;
  std::ostringstream discard;
  std::ostream& log = lead ? err : discard;
  for (const auto& warning : report.warnings) log << "warning: " << printable(warning) << '\n';
  for (const auto& line : report.printed) log << "print: " << line << '\n';
  for (const auto& name : report.missing) log << "warning: missing from the checkpoint (strict = false; the parameter stays empty): " << escape_invalid_utf8(name) << '\n';
  for (const auto& name : report.unexpected) log << "warning: unexpected checkpoint tensor (not used): " << escape_invalid_utf8(name) << '\n';
  if (options.stats)
    log << "loaded " << config.name << " (" << model->architecture() << ", " << convert::dtype_torch_name(storage::dtype_of(model->dtype())) << ", "
        << model->device() << "): " << counted(report.tensors, "tensor") << ", " << format_bytes(report.bytes) << " ("
        << report.zero_copy << " mapped without a copy); plan " << ms(report.plan_seconds) << ", load "
        << ms(report.load_seconds) << "; peak RSS " << format_bytes(rss_loaded) << " (+"
        << format_bytes(rss_loaded - rss_before) << " while loading; largest tensor " << format_bytes(report.largest)
        << ")\n";
  nlohmann::json stats = {{"model", config.name},         {"architecture", model->architecture()},
                          {"tensors", report.tensors},     {"bytes", report.bytes},
                          {"zero_copy", report.zero_copy}, {"plan_seconds", report.plan_seconds},
                          {"load_seconds", report.load_seconds}, {"peak_rss_before_load", rss_before},
                          {"peak_rss_loaded", rss_loaded}};
  const auto write_stats = [&] {
    stats["bytes_read"] = loaded.source->map.bytes_read();
    if (const auto ranks = loaded.weights->each_rank(static_cast<int64_t>(peak_rss()))) {
      stats["ranks"] = nlohmann::json::array();
      for (size_t r = 0; r < ranks->size(); ++r) {
        const auto& figures = (*ranks)[r];
        stats["ranks"].push_back({{"rank", r},
                                  {"peak_rss", figures.peak_rss},
                                  {"peak_weights", figures.peak_weights},
                                  {"slices", figures.share},
                                  {"bytes_read", figures.bytes_read}});
      }
    }
    if (options.stats_json.empty() || !lead) return;
    std::ofstream(options.stats_json) << stats.dump(2) << '\n';
  };
  if (options.input.empty()) return write_stats();
  auto& weights = *loaded.weights;
  const bool tracing = !options.trace.empty();
  if (tracing && !weights.start_trace())
    fail(options.config, "--trace needs [vram] management without [partition] (a [vram].limit, or a preparing dtype "
                         "other than the computation's)");

  storage::NamedTensors outputs;
  std::vector<double> seconds;
  const int repeat = std::max(options.repeat, 1);
  model::reset_cpu_allocation_peak();
  const uint64_t allocated_before = model::cpu_allocations().live;
  for (int i = 0; i < repeat; ++i) {
    if (i == repeat - 1 && tracing) weights.start_trace();  // the last forward's alone
    const auto start = std::chrono::steady_clock::now();
    c10::InferenceMode inference;
    outputs.clear();  // the last forward's outputs are not this one's activations
    try {
      outputs = model->forward(inputs);
    } catch (const c10::Error& e) {
      throw Error(config.path + ": forward failed: " + e.what_without_backtrace());
    } catch (const dist::RankFailure&) {
      throw;
    } catch (const Error& e) {
      fail(options.input, e.what());
    }
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (i == 0) stats["rss_after_first_forward"] = rss();
  }
  stats["rss_end"] = rss();
  if (!model->device().is_cuda()) {
    if (counting) {
      // What the CPU allocator handed out beyond what was live before: activations and other
      // temporaries (with [vram] streaming from disk, also the converter's intermediate tensors).
      const uint64_t activations = model::cpu_allocations().peak - allocated_before;
      stats["activations_peak"] = activations;
      if (options.stats) log << "activations peak " << format_bytes(activations) << " (CPU allocator, beside the weights)\n";
    }
  } else {
    // Everything the forwards allocated on the GPU at their peak; less the weights, the activations.
    const auto device = model->device();
    const auto peak = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index()).allocated_bytes[0].peak;
    stats["device_peak_allocated"] = peak;
    if (const auto managed = weights.stats())
      stats["activations_peak"] = std::max<int64_t>(0, peak - static_cast<int64_t>(managed->peak));
    if (options.stats) log << "device peak allocated " << format_bytes(static_cast<uint64_t>(peak)) << '\n';
  }
  if (const auto managed = weights.stats()) {
    const auto& v = *managed;
    stats["vram"] = v;
    if (tracing) {
      nlohmann::json events = nlohmann::json::array();
      for (const auto& e : weights.take_trace()) events.push_back({e.seconds, e.held, e.layer->path(), e.kind});
      std::ofstream(options.trace) << nlohmann::json{{"model", config.name}, {"limit", v.limit}, {"peak", v.peak}, {"events", events}}.dump() << '\n';
    }
    if (options.stats) log << "vram: " << v.plan << "; " << counted(v.loads, "streamed load") << " ("
                           << format_bytes(v.bytes_streamed) << ", " << format_bytes(v.bytes_packed) << " of it packed), "
                           << v.prefetched << " prefetched, waited " << ms(v.wait_seconds) << '\n';
    if (options.stats && v.expert_slots)
      log << "experts: " << v.resident_expert_slots << " of " << v.expert_slots << " expert layers resident; "
          << counted(v.expert_hits, "hit") << ", " << v.expert_misses << (v.expert_misses == 1 ? " miss" : " misses")
          << " (" << format_bytes(v.expert_bytes_streamed) << " brought in), " << counted(v.expert_swaps, "swap") << '\n';
  }
  const double first = seconds.front();
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  stats["forward_first_seconds"] = first;
  stats["forward_median_seconds"] = median;
  stats["forwards"] = seconds.size();
  stats["peak_rss"] = peak_rss();
  if (options.stats)
    log << "forward " << ms(first) << " (median of " << seconds.size() << ": " << ms(median)
        << "); peak RSS " << format_bytes(peak_rss()) << '\n';
  write_stats();
  if (!lead) return;

  if (!options.output.empty()) {
    storage::save_tensors(options.output, outputs, {{"model", config.name}, {"produced_by", "vramd"}});
    return;
  }
  for (const auto& [name, tensor] : outputs)
    out << name << ' ' << storage::torch_name(tensor.scalar_type()) << ' ' << format_shape(tensor.sizes().vec()) << '\n';
}

}  // namespace vramd::cli
