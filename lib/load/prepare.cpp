#include "load/prepare.hpp"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <set>

#include "convert/converter.hpp"
#include "load/conversion.hpp"
#include "family/catalog.hpp"
#include "hparams/hyperparams.hpp"
#include "load/lora.hpp"
#include "load/names.hpp"
#include "model/registry.hpp"
#include "storage/tensor_io.hpp"
#include "util/clock.hpp"
#include "util/format.hpp"

namespace vramd::load {
namespace fs = std::filesystem;
using namespace model;

namespace {

using Clock = std::chrono::steady_clock;

// "auto": the floating dtype that holds most of the checkpoint's bytes (bfloat16 for float8).
c10::ScalarType dominant_dtype(const convert::ConversionPlan& plan) {
  std::map<storage::DType, uint64_t> bytes;
  for (const auto& [target, expr] : plan.tensors)
    if (storage::is_floating(expr->dtype)) bytes[expr->dtype] += storage::element_count(expr->shape) * storage::dtype_bits(expr->dtype);
  if (bytes.empty()) return c10::kFloat;
  auto most = std::max_element(bytes.begin(), bytes.end(), [](auto& a, auto& b) { return a.second < b.second; });
  const c10::ScalarType type = storage::scalar_type(most->first);
  return type == c10::kFloat || type == c10::kBFloat16 || type == c10::kHalf ? type : c10::kBFloat16;
}

}  // namespace

Prepared prepare(const config::ModelConfig& config) {
  const auto plan_start = Clock::now();
  const std::string& where = config.path;
  auto map = config::open_checkpoint(config);
  LoadReport report;
  report.checkpoint = map.description();
  report.warnings.assign(map.warnings().begin(), map.warnings().end());
  if (map.tensors().empty()) fail(where, "checkpoint " + map.description() + " holds no tensors" +
                                             (config.prefix.empty() ? "" : " under prefix " + quote(config.prefix)));

  const std::string folder = fs::path(map.files()[0].path).parent_path().string();
  const hparams::Hyperparams hyperparams = hparams::Hyperparams::for_model(config, map);
  const family::Catalog families(config.architecture_folders);
  if (config.architecture.empty() && hyperparams.string("model_type", "").empty())
    throw NoArchitecture(where + ": no architecture: set architecture = \"...\" (" + families.names() +
                         ", weights) or put a config.json with model_type in " + folder);

  const auto plan = [&] {
    try {
      return conversion_plan(config, map, hyperparams);
    } catch (const Error& e) {
      if (config.converter == config::kTransformersConverter) throw;  // names the config's key already
      fail(where, std::string("converter: ") + e.what());
    }
  }();
  report.printed = plan.printed;
  const auto& computation = config.vram.computation.dtype;
  const c10::ScalarType dtype = computation ? storage::scalar_type(*computation) : dominant_dtype(plan);
  std::unique_ptr<Model> model;
  try {
    TensorShapes shapes;
    for (const auto& [target, expr] : plan.tensors) shapes.emplace_back(target, expr->shape);
    model = build_model(config.architecture, hyperparams, dtype, shapes, families);
  } catch (const Error& e) {
    fail(where, e.what());
  }
  const std::string& architecture = model->architecture();

  // Every checkpoint tensor to its parameter.
  const NameMatcher names(*model, plan);
  std::vector<weights::Assignment> assignments;
  std::vector<std::string> mismatched, unexpected;
  std::set<const Parameter*> assigned;
  for (const auto& [target, expr] : plan.tensors) {
    const std::string name = names.canonical(target);
    Parameter* parameter = model->find(name);
    if (!parameter) {
      if (!model->ignores(name)) unexpected.push_back(target);
      continue;
    }
    if (parameter->tied) continue;  // loaded through the parameter it is tied to
    assigned.insert(parameter);
    if (expr->shape != parameter->shape) {
      mismatched.push_back(quote(target) + " is " + format_shape(expr->shape) + ", the architecture expects " +
                           format_shape(parameter->shape));
      continue;
    }
    // Architecture "weights" computes nothing: its integer tensors are held as they are.
    const bool as_is = architecture == "weights" && config.partition.world_size == 1 && weights::held_as_is(expr->dtype);
    if (!storage::is_floating(expr->dtype) && !as_is) {
      mismatched.push_back(quote(target) + " is " + std::string(storage::dtype_name(expr->dtype)) +
                           (architecture != "weights" ? ", the architecture expects floating-point weights"
                            : config.partition.world_size > 1 ? ", and a partitioned model holds floating-point weights only"
                                                              : ", which architecture weights holds only as GGUF blocks"));
      continue;
    }
    uint64_t order = UINT64_MAX;
    expr->for_each_source([&](const convert::Expr& source) {
      const auto& info = map.at(source.source, source.shard);
      order = std::min(order, (uint64_t{info.file} << 48) + info.offset);
    });
    assignments.push_back({parameter, expr, order});
  }
  std::vector<std::string> missing;
  for (const Parameter* parameter : model->parameters())
    if (!parameter->tied && !assigned.count(parameter)) missing.push_back(parameter->name);

  std::string problems;
  const auto add = [&](const std::string& text) { problems += (problems.empty() ? "" : "; ") + text; };
  if (!mismatched.empty()) add("mismatched: " + joined(mismatched));
  if (config.strict && !missing.empty())
    add(std::to_string(missing.size()) + " missing: " + listed(missing));
  if (config.strict && !unexpected.empty())
    add(std::to_string(unexpected.size()) + " unexpected: " + listed(unexpected));
  if (!problems.empty()) {
    // Loading anyway helps only where some names matched; where none did, the names are wrong.
    const std::string advice =
        !mismatched.empty() ? ""
        : !assigned.empty() ? " (strict = false loads anyway)"
        : " (no tensor matches a parameter: check the prefix" + std::string(config.converter.empty() ? ", or give a converter" : " and the converter") +
              "; vramctl convert shows the names it makes)";
    fail(where, "checkpoint " + map.description() + " does not fit architecture " + architecture + " (" +
                    counted(plan.tensors.size(), "tensor") + (config.converter.empty() ? "" : " from " + config.converter) +
                    "): " + problems + advice);
  }
  attach_loras(config, *model, assignments, report);
  report.missing = std::move(missing);
  report.unexpected = std::move(unexpected);
  report.plan_seconds = seconds_since(plan_start);
  std::sort(assignments.begin(), assignments.end(), [](auto& a, auto& b) { return a.order < b.order; });
  for (const auto& a : assignments) {
    const uint64_t bytes = weights::held_bytes(a, weights::held_dtype(a, dtype, /*packed=*/false));  // an integer: its own
    report.bytes += bytes;
    report.largest = std::max(report.largest, bytes);
  }
  report.tensors = assignments.size();
  return {std::move(map), architecture, std::move(model), std::move(assignments), std::move(report)};
}


}  // namespace vramd::load
