#include "config/model_config.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <span>
#include <sstream>

#include "config/toml_schema.hpp"
#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"

namespace vramd::config {
namespace fs = std::filesystem;

namespace {

using storage::DType;
constexpr DType kDtypes[] = {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3, DType::F8_E5M2};
constexpr DType kComputeDtypes[] = {DType::F32, DType::BF16, DType::F16};

// "auto" or one of `allowed`, by LibTorch's name; nullopt when it is neither.
std::optional<Dtype> parse_config_dtype(const std::string& name, std::span<const DType> allowed) {
  if (name == "auto") return Dtype{};
  const auto dtype = storage::parse_torch_dtype(name);
  if (!dtype || std::ranges::find(allowed, *dtype) == allowed.end()) return std::nullopt;
  return Dtype{*dtype};
}

bool computable(const Dtype& dtype) { return !dtype || std::ranges::find(kComputeDtypes, *dtype) != std::end(kComputeDtypes); }

// Docker's rule for names: an ASCII letter or digit, then letters, digits, '-', '_' and '.';
// a name is a path segment of the API (/v1/models/NAME) and a label in metrics.
bool valid_name(const std::string& name) {
  const auto ascii_alnum = [](unsigned char c) { return c < 0x80 && std::isalnum(c); };
  return !name.empty() && name.size() <= 128 && ascii_alnum(name[0]) &&
         std::all_of(name.begin(), name.end(), [&](unsigned char c) {
           return ascii_alnum(c) || c == '-' || c == '_' || c == '.';
         });
}

// Reads `[vram].<key>` = { device, dtype }; what it leaves out, or gets wrong, comes from
// `state` (the state it defaults to).
DeviceState read_state(TableReader& vram, std::string_view key, DeviceState state, bool disk_allowed) {
  auto table = vram.table(key);
  if (!table) return state;
  if (auto device = table->string("device")) {
    const auto parsed = Device::parse(*device);
    if (parsed && (disk_allowed || !parsed->is_disk()))
      state.device = *parsed;
    else if (parsed)
      table->bad_value("device", "only offload and onload can be on disk; " + std::string(key) +
                                     " needs \"cpu\", \"cuda\" or \"cuda:N\"");
    else
      table->bad_value("device", std::string("expected ") + (disk_allowed ? "\"disk\", " : "") +
                                     "\"cpu\", \"cuda\" or \"cuda:N\"");
  }
  if (auto name = table->string("dtype")) {
    if (auto dtype = parse_config_dtype(*name, kDtypes); dtype && *dtype)
      state.dtype = *dtype;
    else
      table->bad_value("dtype", "expected float32, bfloat16, float16, float8_e4m3fn or float8_e5m2");
  }
  if (auto packed = table->boolean("packed")) {
    if (key == "computation")
      table->bad_value("packed", "ops compute on unpacked weights; GGUF blocks stay packed in offload, onload and "
                                 "preparing, and are unpacked into the computation dtype right before each op");
    else if (state.device.is_disk())
      table->bad_value("packed", std::string(key) + " is on disk, where weights are the checkpoint's own bytes; " +
                                     "packed says how a state in memory holds them (preparing = { packed = true } " +
                                     "streams GGUF blocks packed)");
    else
      state.packed = *packed;
  }
  table->finish();
  return state;
}

std::string budgets_text(const DaemonConfig& daemon) {
  std::string text;
  for (const auto& [device, bytes] : daemon.budgets) text += (text.empty() ? "" : ", ") + device + " " + format_bytes(bytes);
  return text.empty() ? "none" : text;
}

void read_vram(TableReader& root, const DaemonConfig& daemon, const Dtype& base_dtype, VramConfig& vram) {
  // "auto": the checkpoint's own dtype, settled when the model loads.
  // A float8 model dtype: weights wait and rest in it, and are computed in bfloat16.
  const bool float8 = !computable(base_dtype);
  vram.computation = {Device{}, float8 ? Dtype{DType::BF16} : base_dtype};
  const auto prepared = [&] { return DeviceState{vram.computation.device, float8 ? base_dtype : vram.computation.dtype}; };
  auto table = root.table("vram");
  if (!table) {
    vram.preparing = vram.onload = vram.offload = prepared();
    return;
  }
  vram.computation = read_state(*table, "computation", vram.computation, false);
  vram.preparing = read_state(*table, "preparing", prepared(), false);
  if (vram.preparing.device != vram.computation.device)
    table->bad_value("preparing", "preparing is where weights wait, ready, on the computation device (" +
                                      vram.computation.device.str() + "), not on " + vram.preparing.device.str() +
                                      "; weights that rest elsewhere belong in onload");
  vram.onload = read_state(*table, "onload", vram.preparing, true);
  vram.offload = read_state(*table, "offload", vram.onload, true);
  if (!computable(vram.computation.dtype))
    table->bad_value("computation", "weights can rest in float8 (offload, onload, preparing) but are computed "
                                    "in float32, bfloat16 or float16");
  // A limit on a device needs the daemon's budget for it, and must fit in it.
  // `also`: what else the device holds under this budget, which the message then names.
  const auto within_budget = [&](const char* key, const Device& where, uint64_t bytes, std::string also = "") {
    const std::string device = where.str();
    auto budget = daemon.budgets.find(device);
    if (budget == daemon.budgets.end() && daemon.path.empty())
      table->bad_value(key, "a limit on " + device + " needs the daemon config's budget for it, and no daemon config " +
                                "was found" + (daemon.looked_for.empty() ? "" : " (looked for " + quote(daemon.looked_for) + ")") +
                                ": give one with --daemon-config");
    else if (budget == daemon.budgets.end())
      table->bad_value(key, "a limit on " + device + ", for which " + daemon.path + " sets no budget (budgets: " +
                                budgets_text(daemon) + ")");
    else if (bytes > budget->second)
      table->bad_value(key, (also.empty() ? "" : "with " + also + ", ") + "more than the daemon's whole budget for " +
                                device + " (" + format_bytes(budget->second) + ")");
  };
  vram.limit = table->size("limit");
  if (vram.limit) within_budget("limit", vram.computation.device, *vram.limit);
  vram.onload_limit = table->size("onload_limit");
  if (vram.onload_limit) {
    if (vram.onload.device.is_disk())
      table->bad_value("onload_limit", "it caps the weights resting on the onload device, and onload is \"disk\"; "
                                       "give onload a device such as \"cpu\"");
    else if (uint64_t both = 0; vram.onload.device == vram.computation.device && vram.limit)  // both on one device
      within_budget("onload_limit", vram.onload.device,
                    __builtin_add_overflow(*vram.onload_limit, *vram.limit, &both) ? UINT64_MAX : both,  // no wrap to fit
                    "vram.limit (" + format_bytes(*vram.limit) + ") on the same device");
    else
      within_budget("onload_limit", vram.onload.device, *vram.onload_limit);
  }
  if (const toml::node* direct_io = table->node("direct_io")) {
    if (direct_io->is_boolean())
      vram.direct_io = *direct_io->value<bool>();
    else if (direct_io->value<std::string>() != "auto")
      table->bad_value("direct_io", "expected true, false or \"auto\"");
  }
  if (auto experts = table->string("experts")) {
    if (*experts == "cpu" && vram.computation.device == Device::named("cpu"))
      table->bad_value("experts", "\"cpu\" computes the experts on the CPU beside the rest of the model on a GPU, and "
                                  "this model computes on the CPU already; leave it out");
    else if (*experts == "cpu")
      vram.experts_on_cpu = true;
    else if (*experts != "stream")
      table->bad_value("experts", "expected \"stream\" (the default: under limit, the experts a batch is routed to "
                                  "are brought to the computation device) or \"cpu\" (computed on the CPU)");
  }
  table->finish();
}

}  // namespace

std::string dtype_str(const Dtype& dtype) { return dtype ? std::string(storage::torch_dtype_name(*dtype)) : "auto"; }

std::string where(const ModelConfig& config, std::string_view key) {
  for (std::string path(key);; path.resize(path.rfind('.'))) {
    if (const auto it = config.positions.find(path); it != config.positions.end())
      return escape_invalid_utf8(config.path) + ":" + std::to_string(it->second.first) + ":" +
             std::to_string(it->second.second);
    if (path.find('.') == std::string::npos) return escape_invalid_utf8(config.path);
  }
}

bool rests_for_clients(const ModelConfig& config) {
  const VramConfig& vram = config.vram;
  return config.architecture == "weights" && (vram.limit || vram.preparing.dtype != vram.computation.dtype ||
                                              vram.onload.dtype != vram.computation.dtype || vram.onload.packed == true);
}

bool clients_apply_adapters(const ModelConfig& config) { return config.architecture == "weights" && !config.fuse_lora; }

ModelConfig load_model_config(const std::string& path, const DaemonConfig& daemon) {
  return load_model_config(path, read_regular_file(path, kMaxConfigBytes), daemon);
}

namespace {

// Where a file a model config names may be: beside the config, else (a relative name) in one
// of the daemon's folders for that kind of file.
std::vector<fs::path> script_candidates(const std::string& name, const fs::path& folder, const std::vector<std::string>& folders) {
  std::vector<fs::path> candidates = {folder / name};
  if (fs::path(name).is_relative())
    for (const auto& scripts : folders) candidates.push_back(fs::path(scripts) / name);
  return candidates;
}

std::optional<std::string> find_script(const std::string& name, const fs::path& folder, const std::vector<std::string>& folders) {
  for (const auto& candidate : script_candidates(name, folder, folders)) {
    std::error_code ec;  // a looping link is no script, not an exception
    if (fs::is_regular_file(candidate, ec)) return fs::absolute(candidate).lexically_normal().string();
  }
  return std::nullopt;
}

std::string searched_text(const std::string& name, const fs::path& folder, const std::vector<std::string>& folders) {
  std::string searched;
  for (const auto& candidate : script_candidates(name, folder, folders))
    searched += (searched.empty() ? "" : ", ") + escape_invalid_utf8(candidate.lexically_normal().string());
  return searched;
}

}  // namespace

ModelConfig load_model_config(const std::string& path, const std::string& text, const DaemonConfig& daemon) {
  Problems problems(path);
  auto document = parse_toml_text(text, path, problems);
  problems.throw_if_any();

  ModelConfig config;
  config.path = path;
  note_positions(*document, "", config.positions);
  const fs::path folder = fs::absolute(path).parent_path();
  TableReader root(*document, "", problems);

  const auto name = root.string("name");
  config.name = name.value_or(fs::path(path).stem().string());
  if (!valid_name(config.name))
    root.bad_value("name", std::string(name ? "" : "the file's name " + quote(config.name) + " is no model name: ") +
                               "a name is 1-128 ASCII letters, digits, '-', '_' or '.', starting with a letter or digit");
  config.architecture = root.string("architecture").value_or("");
  config.architecture_folders = daemon.architectures;
  config.python = daemon.python;
  if (config.architecture.ends_with(".toml")) {  // a family file of the user's
    if (auto found = find_script(config.architecture, folder, daemon.architectures))
      config.architecture = *found;
    else
      root.bad_value("architecture", "no such family file (looked for " +
                                         searched_text(config.architecture, folder, daemon.architectures) + ")");
  }

  if (auto checkpoint = root.strings("checkpoint")) {
    if (checkpoint->empty()) root.bad_value("checkpoint", "names no checkpoint");
    for (const auto& source : *checkpoint) config.checkpoint.push_back((folder / source).lexically_normal().string());
  } else if (!root.raw().contains("checkpoint")) {
    root.problem("missing key 'checkpoint' (a file, folder, index.json, glob or list of them)");
  }
  config.prefix = root.string("prefix").value_or("");
  config.keep_prefix = root.boolean("keep_prefix").value_or(false);
  config.strict = root.boolean("strict").value_or(true);
  config.fuse_lora = root.boolean("fuse_lora").value_or(true);
  for (auto& table : root.tables("lora")) {
    LoraConfig lora;
    if (auto adapter = table.string("path"))
      lora.path = (folder / *adapter).lexically_normal().string();
    else if (!table.raw().contains("path"))
      table.problem("missing key 'path' in [[lora]] (a PEFT folder or a .safetensors file of a LoRA adapter)");
    lora.scale = table.number("scale", -1e6, 1e6).value_or(1.0);
    table.finish();
    config.lora.push_back(std::move(lora));
  }

  // A GGUF file's names are llama.cpp's: the shipped gguf.lua makes them Hugging Face's, for a
  // family vramd runs. A "weights" model takes the file's own (a diffusion model's GGUF keeps
  // the module's names).
  const bool gguf = config.checkpoint.size() == 1 && config.checkpoint[0].ends_with(".gguf");
  auto converter = root.string("converter");
  if (!converter && gguf && config.architecture != "weights") converter = "gguf.lua";
  if (converter && *converter == kTransformersConverter) {
    config.converter = kTransformersConverter;
    // transformers' rules read Hugging Face's names, which gguf.lua makes of llama.cpp's.
    if (gguf) {
      if (const auto found = find_script("gguf.lua", folder, daemon.converters))
        config.converter_first = *found;
      else
        root.bad_value("converter", "transformers' rules read Hugging Face's names, which the shipped converter "
                                    "gguf.lua makes of a GGUF file's, and none of the daemon's converter folders holds "
                                    "it (looked for " + searched_text("gguf.lua", folder, daemon.converters) + ")");
    }
  } else if (converter && !converter->empty()) {  // "": the checkpoint's own names, a GGUF file's too
    const auto found = find_script(*converter, folder, daemon.converters);
    if (!found) {
      const std::string searched = searched_text(*converter, folder, daemon.converters);
      if (root.raw().contains("converter"))
        root.bad_value("converter", "no such script (looked for " + searched + ")");
      else
        root.bad_value("checkpoint", "is GGUF, whose names the shipped converter gguf.lua reads, which none of the "
                                     "daemon's converter folders holds (looked for " + searched +
                                     "); set converter = \"/path/to/vramd/scripts/converters/gguf.lua\"");
    } else {
      config.converter = *found;
    }
  }

  if (auto dtype = parse_config_dtype(root.string("dtype").value_or("auto"), kDtypes))
    config.dtype = *dtype;
  else
    root.bad_value("dtype", "expected auto, float32, bfloat16, float16, float8_e4m3fn or float8_e5m2");
  read_vram(root, daemon, config.dtype, config.vram);
  if (rests_for_clients(config) && !config.vram.onload.device.is_cpu() && !config.vram.onload.device.is_disk())
    root.bad_value("architecture", "a \"weights\" model with a [vram] table rests in host memory for the clients that "
                                   "manage it, and its onload device is " + config.vram.onload.device.str() +
                                   ": set onload to \"cpu\" (or \"disk\": the checkpoint's page cache)");

  config.residency.keep_alive = daemon.keep_alive;
  if (auto residency = root.table("residency")) {
    if (auto keep_alive = residency->duration("keep_alive")) config.residency.keep_alive = *keep_alive;
    config.residency.pinned = residency->boolean("pinned").value_or(false);
    config.residency.preload = residency->boolean("preload").value_or(false);
    residency->finish();
  }

  if (auto partition = root.table("partition")) {
    config.partition.world_size = static_cast<int>(partition->integer("world_size", 1, 4096).value_or(1));
    config.partition.replicate = partition->strings("replicate").value_or(std::vector<std::string>{});
    if (auto timeout = partition->duration("timeout")) {
      if (!*timeout) partition->bad_value("timeout", "ranks that never answer must fail the load: give a duration such as \"60s\"");
      else config.partition.timeout = **timeout;
    }
    if (!partition->raw().contains("world_size")) partition->problem("missing key 'world_size' in [partition] (the number of ranks)");
    const auto& vram = config.vram;
    if (config.partition.world_size > 1 && (vram.offload.packed == true || vram.onload.packed == true || vram.preparing.packed == true))
      partition->bad_value("world_size", "each rank holds a slice of every weight, cut element by element, which would "
                                         "cut GGUF blocks apart: remove packed = true from [vram] to partition the model");
    partition->finish();
  }

  config.arch_json = "{}";
  if (auto arch = root.table("arch")) {
    for (auto key : arch->keys()) arch->node(key);  // any hyperparameter may be overridden
    std::ostringstream json;
    json << toml::json_formatter(arch->raw());
    config.arch_json = json.str();
  }
  root.finish();
  problems.throw_if_any();
  return config;
}

}  // namespace vramd::config
