#include "cli/convert.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <ostream>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "convert/converter.hpp"
#include "convert/evaluate.hpp"
#include "load/conversion.hpp"
#include "storage/safetensors_writer.hpp"
#include "storage/tensor_io.hpp"
#include "storage/disk_map.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::cli {

void convert(const ConvertOptions& options, std::ostream& out, std::ostream& err) {
  auto model = config::load_model_config(options.config, config::find_daemon_config(options.daemon_config));
  auto map = config::open_checkpoint(model);
  for (const auto& warning : map.warnings()) err << "warning: " << printable(warning) << '\n';
  auto plan = load::conversion_plan(model, map);
  for (const auto& line : plan.printed) err << "print: " << line << '\n';
  if (!options.output.empty()) {
    // One tensor in memory at a time, read into fresh memory (not the file's mapping), so that
    // merging a checkpoint (a DCP folder's chunks) takes the largest tensor, not the model.
    std::vector<storage::TensorSlot> slots;
    for (const auto& [target, expr] : plan.tensors) slots.push_back({target, expr->dtype, expr->shape});
    at::Tensor held;
    storage::write_safetensors(options.output, slots, {{"converted_by", "vramd"}}, [&](size_t i) {
      held = at::Tensor();
      held = convert::evaluate(*plan.tensors[i].expr, map, storage::ReadMode::Copy);
      return std::span<const std::byte>(static_cast<const std::byte*>(held.const_data_ptr()), held.nbytes());
    });
    uint64_t bytes = 0;
    for (const auto& slot : slots) bytes += storage::dtype_bytes(slot.dtype, storage::element_count(slot.shape)).value_or(0);
    // On stderr: standard output has the plan (as JSON with --json).
    err << "wrote " << counted(slots.size(), "tensor") << ", " << format_bytes(bytes) << ", to "
        << escape_invalid_utf8(options.output) << '\n';
  }

  if (options.json) {
    nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
    for (const auto& [target, expr] : plan.tensors)
      tensors[target] = {{"dtype", storage::dtype_name(expr->dtype)}, {"shape", expr->shape},
                         {"expression", expr->describe()}};
    out << nlohmann::ordered_json{{"model", model.name}, {"converter", model.converter}, {"tensors", tensors},
                                  {"unused", plan.unused}}
               .dump(2, ' ', false, nlohmann::json::error_handler_t::replace)
        << '\n';
    return;
  }
  out << "model " << model.name << ", converter " << (model.converter.empty() ? "(none)" : model.converter) << ": "
      << counted(plan.tensors.size(), "tensor") << "\n";
  size_t name_width = 0, shape_width = 0;
  for (const auto& [target, expr] : plan.tensors) {
    name_width = std::max(name_width, escape_invalid_utf8(target).size());
    shape_width = std::max(shape_width, format_shape(expr->shape).size());
  }
  for (const auto& [target, expr] : plan.tensors)
    out << "  " << pad(escape_invalid_utf8(target), name_width) << "  " << pad(std::string(storage::dtype_name(expr->dtype)), 7) << "  "
        << pad(format_shape(expr->shape), shape_width) << "  = " << expr->describe() << '\n';
  if (!plan.unused.empty()) {
    out << plan.unused.size() << " source tensors are not used:";
    for (const auto& key : plan.unused) out << ' ' << escape_invalid_utf8(key);
    out << '\n';
  }
}

}  // namespace vramd::cli
