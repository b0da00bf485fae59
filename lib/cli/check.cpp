#include "cli/check.hpp"

#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "convert/converter.hpp"
#include "load/conversion.hpp"
#include "load/dry_run.hpp"
#include "storage/disk_map.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"
#include "weights/holdings.hpp"

namespace vramd::cli {
namespace {

struct Verdict {
  std::string path;
  std::string name;
  std::vector<std::string> problems;
  uint64_t tensors = 0;
  uint64_t bytes = 0;
  std::vector<std::string> warnings;
  std::string architecture;  // "bert, Float" once the dry run passed
  std::string plan;          // streamed weights' plan
  std::vector<std::string> loras;  // each adapter, what it changes and where it is added
};

// An adapter as check shows it: its file and scale, what it changes, and where it is added.
std::string lora_line(const model::AdapterReport& adapter, const config::ModelConfig& model) {
  const char* where = model.fuse_lora                             ? "added to the weights as they are read"
                      : config::clients_apply_adapters(model) ? "applied by the clients that manage it"
                                                              : "computed beside each layer's op";
  std::ostringstream line;  // the scale as vramctl lora prints it
  line << adapter.path << " at scale " << adapter.scale << " (" << adapter.format << ", " << counted(adapter.modules, "weight")
       << "): " << where;
  return line.str();
}

Verdict check_one(const std::string& path, const config::DaemonConfig& daemon) {
  Verdict verdict{path, {}, {}, 0, 0, {}, {}, {}, {}};
  try {
    auto model = config::load_model_config(path, daemon);
    verdict.name = model.name;
    try {
      auto map = config::open_checkpoint(model);
      verdict.tensors = map.tensors().size();
      verdict.bytes = map.total_bytes();
      verdict.warnings.assign(map.warnings().begin(), map.warnings().end());
      try {
        // The whole load short of reading data: converter, architecture, names, shapes, dtypes.
        auto dry = load::dry_run(model);
        weights::check_budgets(model, dry, daemon);
        verdict.tensors = dry.report.tensors;
        verdict.bytes = dry.report.bytes;
        verdict.architecture = dry.architecture + ", " + dry.dtype;
        if (dry.weights) verdict.plan = dry.weights->plan;
        for (const auto& adapter : dry.report.adapters) verdict.loras.push_back(lora_line(adapter, model));
        for (const auto& name : dry.report.missing)
          verdict.warnings.push_back(path + ": missing (strict = false): " + escape_invalid_utf8(name));
        for (const auto& name : dry.report.unexpected)
          verdict.warnings.push_back(path + ": unexpected (strict = false): " + escape_invalid_utf8(name));
      } catch (const model::NoArchitecture&) {
        verdict.warnings.push_back(path + ": no architecture, so vramd cannot load it; checked the index and converter only");
        if (!model.converter.empty()) try {
            auto plan = load::conversion_plan(model, map);
            verdict.tensors = plan.tensors.size();
            verdict.bytes = 0;
            for (const auto& conversion : plan.tensors)
              verdict.bytes += storage::dtype_bytes(conversion.expr->dtype, storage::element_count(conversion.expr->shape)).value_or(0);
          } catch (const Error& e) {
            verdict.problems.push_back(path + ": converter: " + e.what());
          }
      } catch (const Error& e) {
        verdict.problems.push_back(e.what());
      }
    } catch (const Error& e) {
      verdict.problems.push_back(path + ": checkpoint: " + e.what());
    }
  } catch (const Error& e) {
    verdict.problems = split_lines(e.what());
  } catch (const std::exception& e) {  // a fault of vramd's own, but one config's: the others are still checked
    verdict.problems = {path + ": " + e.what()};
  }
  return verdict;
}

}  // namespace

int check(const CheckOptions& options, std::ostream& out, std::ostream& err) {
  const config::DaemonConfig daemon = config::find_daemon_config(options.daemon_config);

  int failed = 0;
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const auto& path : options.configs) {
    Verdict verdict = check_one(path, daemon);
    failed += !verdict.problems.empty();
    if (options.json) {
      results.push_back({{"path", verdict.path}, {"ok", verdict.problems.empty()}, {"name", verdict.name},
                         {"architecture", verdict.architecture}, {"tensors", verdict.tensors}, {"bytes", verdict.bytes},
                         {"plan", verdict.plan.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(verdict.plan)},
                         {"loras", verdict.loras},
                         {"problems", verdict.problems}, {"warnings", verdict.warnings}});
      continue;
    }
    for (const auto& warning : verdict.warnings) err << "warning: " << printable(warning) << '\n';
    if (verdict.problems.empty()) {
      out << "ok    " << path << ": model " << quote(verdict.name) << ", " << counted(verdict.tensors, "tensor") << ", "
          << format_bytes(verdict.bytes) << (verdict.architecture.empty() ? "" : " (" + verdict.architecture + ")") << '\n';
      if (!verdict.plan.empty()) out << "      plan: " << printable(verdict.plan) << '\n';
      for (const auto& lora : verdict.loras) out << "      lora: " << printable(lora) << '\n';
    } else {
      out << "FAIL  " << path << '\n';
      for (const auto& problem : verdict.problems) out << "      " << printable(problem) << '\n';
    }
  }
  if (options.json)
    out << nlohmann::ordered_json{{"daemon_config", daemon.path}, {"configs", results}}.dump(
               2, ' ', false, nlohmann::json::error_handler_t::replace)
        << '\n';
  return failed;
}

}  // namespace vramd::cli
