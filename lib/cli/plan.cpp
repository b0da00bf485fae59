#include "cli/plan.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <ostream>
#include <unordered_map>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "convert/expr.hpp"
#include "model/device_map.hpp"
#include "load/dry_run.hpp"
#include "model/model.hpp"
#include "storage/dtype.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::cli {
namespace {

storage::DType planning_dtype(const std::string& name) {
  storage::DType dtype;
  try {
    dtype = convert::parse_dtype_name(name);
  } catch (const Error& e) {
    fail("--dtype", e.what());
  }
  if (!storage::is_floating(dtype) || storage::dtype_bits(dtype) % 8)
    fail("--dtype", quote(name) + " is not a dtype weights are kept in (float32, bfloat16, float16, float64, float8_e4m3fn, float8_e5m2)");
  return dtype;
}

// The model's weight-holding layers in order, sized in `dtype`; a parameter tied to another
// layer's counts there. An expert's layers say so: experts are units of their own.
std::vector<model::PlanLayer> plan_layers(const model::Model& model, storage::DType dtype) {
  std::unordered_map<const model::Parameter*, const std::string*> owner;
  for (const auto& layer : model.layers())
    for (const auto& parameter : layer->parameters()) owner[&parameter] = &layer->path();
  std::vector<model::PlanLayer> layers;
  for (const auto& layer : model.layers()) {
    model::PlanLayer planned{layer->path(), 0, {}, layer->routed()};
    for (const auto& parameter : layer->parameters()) {
      if (parameter.tied) {
        const std::string& leader = *owner.at(parameter.tied);
        if (std::find(planned.tied.begin(), planned.tied.end(), leader) == planned.tied.end()) planned.tied.push_back(leader);
        continue;
      }
      planned.bytes += storage::dtype_bytes(dtype, static_cast<uint64_t>(parameter.elements())).value_or(0);
    }
    layers.push_back(std::move(planned));
  }
  return layers;
}

}  // namespace

void plan(const PlanOptions& options, std::ostream& out, std::ostream& err) {
  const auto budgets = model::parse_max_memory(options.max_memory, "--max-memory");
  const std::optional<storage::DType> wanted = options.dtype.empty() ? std::nullopt : std::optional(planning_dtype(options.dtype));
  const auto config = config::load_model_config(options.config, config::find_daemon_config(options.daemon_config));
  auto [dry, model] = load::dry_run_model(config);
  for (const auto& warning : dry.report.warnings) err << "warning: " << printable(warning) << '\n';
  for (const auto& name : dry.report.missing)
    err << "warning: missing from the checkpoint (strict = false): " << escape_invalid_utf8(name) << '\n';
  const storage::DType dtype = wanted.value_or(storage::dtype_of(model->dtype()));
  const std::string dtype_name = convert::dtype_torch_name(dtype);

  const auto layers = plan_layers(*model, dtype);
  const bool balanced = options.strategy != "sequential";
  const auto used_budgets = balanced ? model::balanced_memory(layers, budgets, options.strategy == "balanced_low_0", "--max-memory")
                                     : budgets;
  const model::DeviceMap map = model::plan_device_map(layers, used_budgets, "--max-memory");

  if (options.json) {
    nlohmann::ordered_json units = nlohmann::ordered_json::array(), totals = nlohmann::ordered_json::object(),
                           budget = nlohmann::ordered_json::object(), reserved = nlohmann::ordered_json::object();
    for (const auto& unit : map.units) units.push_back({{"name", unit.name}, {"device", unit.device}, {"bytes", unit.bytes}});
    for (const auto& device : map.devices) {
      totals[device.device] = device.bytes;
      budget[device.device] = device.budget ? nlohmann::ordered_json(*device.budget) : nlohmann::ordered_json();
      reserved[device.device] = device.reserved;
    }
    nlohmann::ordered_json asked = nlohmann::ordered_json::object();  // the budgets before balancing
    for (const auto& b : budgets) asked[b.device] = b.bytes ? nlohmann::ordered_json(*b.bytes) : nlohmann::ordered_json();
    out << nlohmann::ordered_json{{"config", options.config}, {"model", config.name}, {"architecture", dry.architecture},
                                  {"dtype", dtype_name},      {"strategy", options.strategy}, {"max_memory", asked},
                                  {"units", units},           {"totals", totals},
                                  {"budgets", budget},        {"reserved", map.reserved}, {"reserved_by_device", reserved}}
               .dump(2)
        << '\n';
    return;
  }

  uint64_t total = 0;
  for (const auto& unit : map.units) total += unit.bytes;
  out << "model " << quote(config.name) << " (" << dry.architecture << "), " << dtype_name << ": " << format_bytes(total)
      << " in " << map.units.size() << " units\n";
  if (balanced) {
    std::string lowered;
    for (size_t i = 0; i < budgets.size(); ++i)
      if (budgets[i].bytes != used_budgets[i].bytes)
        lowered += (lowered.empty() ? "" : ", ") + used_budgets[i].device + " " + format_bytes(*used_budgets[i].bytes) +
                   " of " + format_bytes(*budgets[i].bytes);
    out << options.strategy << ", as accelerate's get_balanced_memory: "
        << (lowered.empty() ? "no budget lowered (one GPU, or none)" : lowered) << '\n';
  }
  const auto rows = model::collapse_units(map.units);
  size_t name_width = 0, device_width = 0;
  for (const auto& row : rows) name_width = std::max(name_width, row.name.size());
  for (const auto& device : map.devices) device_width = std::max(device_width, device.device.size());
  for (const auto& row : rows) {
    out << "  " << pad(row.name, name_width) << " -> " << pad(row.device, device_width) << "  " << format_bytes(row.bytes);
    const auto layer = std::find_if(layers.begin(), layers.end(), [&](const auto& l) { return l.path == row.name; });
    if (layer != layers.end() && !layer->tied.empty()) out << " (shares its weights with " << layer->tied.front() << ", counted there)";
    out << '\n';
  }
  for (const auto& device : map.devices) {
    if (!device.budget && device.bytes == 0) continue;  // disk, unused and not given
    out << pad(device.device + ":", device_width + 1) << "  " << format_bytes(device.bytes)
        << (device.budget ? " of " + format_bytes(*device.budget) : " (no limit)");
    if (device.reserved) out << ", " << format_bytes(device.reserved) << " kept free to bring in offloaded units";
    out << '\n';
  }
  out << "reserved: " << format_bytes(map.reserved)
      << (map.reserved ? ": the room the first GPU and cpu keep free to bring in the largest unit placed after them, as accelerate does"
                       : " (no unit went past the first GPU or cpu)")
      << '\n';
}

}  // namespace vramd::cli
