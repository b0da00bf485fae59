#include "cli/remote.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <sstream>

#include "client/client.hpp"
#include "config/daemon_config.hpp"
#include "storage/safetensors_header.hpp"
#include "storage/safetensors_writer.hpp"
#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::cli {
namespace {

using nlohmann::json;

// The daemon's advice, which names its API (for curl and every HTTP client), in vramctl's words.
std::string for_vramctl(std::string text) {
  static const std::pair<const char*, const char*> kWords[] = {
      {"GET /v1/models lists them", "vramctl list lists them"},
      {"leave out wait=false", "leave out --no-wait"},
      {"(POST /v1/models/NAME/lease; the Python package's lease())", "(vramctl lease NAME, or the Python package's lease())"},
      {"keep_alive=", "--keep-alive "},
  };
  for (const auto& [api, ours] : kWords)
    if (const auto at = text.find(api); at != std::string::npos) text.replace(at, std::string_view(api).size(), ours);
  return text;
}

json parse_json(const client::Response& response) {
  try {
    return json::parse(response.body);
  } catch (const json::exception&) {
    throw Error("vramd answered " + std::to_string(response.status) + " with a body that is not JSON: " + response.body.substr(0, 200));
  }
}

std::string devices_text(const json& devices) {
  std::string text;
  for (const auto& [device, bytes] : devices.items())
    if (bytes.get<uint64_t>()) text += (text.empty() ? "" : ", ") + device + " " + format_bytes(bytes.get<uint64_t>());
  return text.empty() ? "-" : text;
}

std::string version_text(const json& model) {
  return model.contains("version") && model["version"].is_number_unsigned() ? std::to_string(model["version"].get<uint64_t>())
                                                                             : "-";
}

// Where a model's `total` bytes are: "cpu" when all of them are on one device, else each device's share.
std::string where_text(const json& devices, uint64_t total) {
  if (devices.size() == 1 && devices.begin().value().get<uint64_t>() == total) return devices.begin().key();
  return devices_text(devices);
}

// "    leased by pid 42 (uid 1000, cpu, since 2026-11-23T12:00:00Z; reserves cuda:0 6.00 GiB)" for
// each of a model's leases.
void print_leases(const json& model, std::ostream& out) {
  if (!model.contains("leases")) return;
  for (const auto& lease : model["leases"]) {
    std::string reserved;
    if (lease.contains("reserved"))
      for (const auto& [device, bytes] : lease["reserved"].items())
        reserved += (reserved.empty() ? "; reserves " : ", ") + device + " " + format_bytes(bytes.get<uint64_t>());
    if (lease.contains("peak") && lease["peak"].is_number_unsigned())
      reserved += ", peak " + format_bytes(lease["peak"].get<uint64_t>());
    out << "    leased by pid " << lease["pid"] << " (uid " << lease["uid"] << ", " << lease["device"].get<std::string>()
        << ", since " << lease["since"].get<std::string>() << reserved << ")\n";
  }
}

// A config's problems, one a line, quote the file: each line indented and printable.
void print_lines(const std::string& head, const std::string& text, std::ostream& out) {
  for (const auto& line : split_lines(text)) out << "    " << head << printable(line) << '\n';
}

void print_models(const json& models, std::ostream& out) {
  std::vector<std::vector<std::string>> rows = {{"NAME", "STATE", "ARCH", "DTYPE", "SIZE", "VERSION", "WHERE"}};
  for (const auto& m : models)
    rows.push_back({m["name"].get<std::string>(), m["state"].get<std::string>(), m.value("architecture", "-"),
                    m.value("dtype", "-"), m.contains("bytes") ? format_bytes(m["bytes"].get<uint64_t>()) : "-",
                    version_text(m), devices_text(m["devices"])});
  // Each model's row, then what belongs to it: why it is not loaded, an edit not applied, its leases.
  const auto lines = split_lines(format_table(rows));
  out << lines[0] << '\n';
  for (size_t i = 0; i < models.size(); ++i) {
    const json& m = models[i];
    out << lines[i + 1] << '\n';
    if (m.contains("derived_from"))
      out << "    derived from " << printable(m["derived_from"].get<std::string>()) << " with a converter a client sent\n";
    if (m.contains("reason")) print_lines("", m["reason"].get<std::string>(), out);
    if (m.contains("config_error")) print_lines("edit not applied: ", m["config_error"].get<std::string>(), out);
    print_leases(m, out);
  }
}

// "cpu 1.40 MiB (limit 1.00 MiB, onload 408.00 KiB)" for each device a model's charge is on.
std::string charge_text(const json& charge) {
  std::string text;
  for (const auto& [device, part] : charge.items()) {
    std::string parts;
    for (const auto& [name, bytes] : part["parts"].items())
      parts += (parts.empty() ? "" : ", ") + name + (part["parts"].size() > 1 ? " " + format_bytes(bytes.get<uint64_t>()) : "");
    text += (text.empty() ? "" : ", ") + device + " " + format_bytes(part["bytes"].get<uint64_t>()) + " (" + parts + ")";
  }
  return text.empty() ? "-" : text;
}

// Element `i` of a tensor's bytes `p` as a double; nullopt for a dtype it cannot say.
std::optional<double> element(storage::DType dtype, const std::byte* p, uint64_t i) {
  using storage::DType;
  switch (dtype) {
    case DType::F32: { float f; std::memcpy(&f, p + 4 * i, 4); return f; }
    case DType::F64: { double d; std::memcpy(&d, p + 8 * i, 8); return d; }
    case DType::F16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); return storage::half_to_float(h); }
    case DType::BF16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); uint32_t w = uint32_t{h} << 16; float f; std::memcpy(&f, &w, 4); return f; }
    case DType::I64: { int64_t v; std::memcpy(&v, p + 8 * i, 8); return static_cast<double>(v); }
    case DType::I32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case DType::BOOL: return static_cast<double>(static_cast<uint8_t>(p[i]));
    default: return std::nullopt;
  }
}

// The version of the weights a forward's outputs say they ran on (their __metadata__), or "-".
std::string output_version(const storage::SafetensorsHeader& header) {
  for (const auto& [key, value] : header.metadata)
    if (key == "version") return value;
  return "-";
}

// "name dtype [shape] v0 v1 ..." for each output (its first 8 values), then the version.
void print_tensors(const std::string& bytes, std::ostream& out) {
  const auto* data = reinterpret_cast<const std::byte*>(bytes.data());
  const auto header = storage::parse_safetensors_file({data, bytes.size()});
  for (const auto& t : header.tensors) {
    out << t.name << ' ' << storage::dtype_name(t.dtype) << ' ' << format_shape(t.shape);
    const std::byte* p = data + header.data_offset + t.begin;
    const uint64_t count = storage::element_count(t.shape);
    for (uint64_t i = 0; i < std::min<uint64_t>(count, 8); ++i)
      if (const auto value = element(t.dtype, p, i)) out << ' ' << std::setprecision(6) << *value;
    out << (count > 8 ? " ..." : "") << '\n';
  }
  out << "weights version " << output_version(header) << '\n';
}

// {"version": N, "outputs": {name: {"dtype", "shape", "values": [every value, in order]}}}.
json outputs_json(const std::string& bytes) {
  const auto* data = reinterpret_cast<const std::byte*>(bytes.data());
  const auto header = storage::parse_safetensors_file({data, bytes.size()});
  json outputs = json::object();
  for (const auto& t : header.tensors) {
    const std::byte* p = data + header.data_offset + t.begin;
    json values = json::array();
    for (uint64_t i = 0, n = storage::element_count(t.shape); i < n; ++i)
      if (const auto value = element(t.dtype, p, i)) values.push_back(*value);
    outputs[t.name] = {{"dtype", storage::dtype_name(t.dtype)}, {"shape", t.shape}, {"values", values}};
  }
  const std::string version = output_version(header);
  return {{"version", version == "-" ? json(nullptr) : json(std::stoull(version))}, {"outputs", outputs}};
}

// name=1,2,3;4,5,6 -> a [2, 3] tensor: int64 when every value is an integer, else float32.
std::string inputs_from_values(const std::vector<std::string>& values) {
  struct Parsed {
    std::string name;
    std::vector<int64_t> shape;
    bool integer = true;
    std::vector<double> numbers;
    std::string bytes;
  };
  std::vector<Parsed> parsed;
  for (const auto& value : values) {
    const auto equals = value.find('=');
    if (equals == std::string::npos || equals == 0) fail(value, "expected name=v1,v2,... (rows separated by ';')");
    Parsed p;
    p.name = value.substr(0, equals);
    std::istringstream rows(value.substr(equals + 1));
    int64_t columns = -1, row_count = 0;
    for (std::string row; std::getline(rows, row, ';'); ++row_count) {
      std::istringstream items(row);
      int64_t n = 0;
      for (std::string item; std::getline(items, item, ','); ++n) {
        size_t used = 0;
        double number = 0;
        try {
          number = std::stod(item, &used);
        } catch (const std::exception&) {
        }
        if (used == 0 || item.find_first_not_of(" ", used) != std::string::npos) fail(value, quote(item) + " is not a number");
        p.integer &= item.find_first_of(".eE") == std::string::npos && number == std::floor(number);
        p.numbers.push_back(number);
      }
      if (columns >= 0 && n != columns) fail(value, "rows have different lengths");
      columns = n;
    }
    if (p.numbers.empty()) fail(value, "no values");
    p.shape = {row_count, columns};
    for (double number : p.numbers) {
      if (p.integer) { const auto v = static_cast<int64_t>(number); p.bytes.append(reinterpret_cast<const char*>(&v), 8); }
      else { const auto v = static_cast<float>(number); p.bytes.append(reinterpret_cast<const char*>(&v), 4); }
    }
    parsed.push_back(std::move(p));
  }
  std::vector<storage::TensorData> tensors;
  for (const auto& p : parsed)
    tensors.push_back({p.name, p.integer ? storage::DType::I64 : storage::DType::F32, p.shape,
                       {reinterpret_cast<const std::byte*>(p.bytes.data()), p.bytes.size()}});
  return storage::serialize_safetensors(tensors);
}

class ProgressView {
 public:
  ProgressView(std::ostream& err, const std::string& model, bool enabled)
      : err_(err), model_(model), enabled_(enabled), terminal_(::isatty(STDERR_FILENO)) {}
  void update(const json& line) {
    if (!enabled_ || line.value("status", "") != "loading") return;
    const uint64_t done = line["bytes_done"], total = line["bytes_total"];
    const int percent = total ? static_cast<int>(100 * done / total) : 100;
    if (terminal_) {
      const int width = 30, filled = percent * width / 100;
      err_ << "\rloading " << model_ << " [" << std::string(filled, '#') << std::string(width - filled, ' ') << "] "
           << std::setw(3) << percent << "% " << format_bytes(done) << " of " << format_bytes(total) << std::flush;
      drawn_ = true;
    } else if (percent >= next_percent_) {
      err_ << "loading " << model_ << ": " << percent << "% (" << format_bytes(done) << " of " << format_bytes(total) << ")\n";
      next_percent_ = percent / 25 * 25 + 25;
    }
  }
  void finish() {
    if (drawn_) err_ << '\n';
  }

 private:
  std::ostream& err_;
  std::string model_;
  bool enabled_, terminal_, drawn_ = false;
  int next_percent_ = 0;
};

int run_remote(client::Client& client, const std::string& command, const RemoteOptions& o, std::ostream& out,
               std::ostream& err) {
  const std::string model_path = "/v1/models/" + o.model;
  std::string query;
  const auto add_query = [&](const std::string& key, const std::string& value) {
    query += (query.empty() ? "?" : "&") + key + "=" + value;
  };
  if (!o.keep_alive.empty()) add_query("keep_alive", o.keep_alive);

  const auto refused = [&](const client::Response& response) {
    if (o.json) out << response.body;
    err << "vramctl " << command << ": " << for_vramctl(client::error_text(response)) << '\n';
    return 1;
  };

  if (command == "list" || command == "reload" || command == "status" || command == "health") {
    const bool post = command == "reload";
    const std::string target = command == "list" ? "/v1/models" : "/v1/" + command;
    const auto response = client.request(post ? "POST" : "GET", target);
    if (response.status != 200) return refused(response);
    if (o.json) return out << response.body, 0;
    const json body = parse_json(response);
    if (command == "health") {
      out << "vramd " << body["version"].get<std::string>() << " is up (pid " << body["pid"] << ")\n";
    } else if (command == "status") {
      out << "vramd " << body["version"].get<std::string>() << ", pid " << body["pid"] << ", up "
          << static_cast<int64_t>(body["uptime_seconds"].get<double>()) << " s, "
          << counted(body["connections"].get<uint64_t>(), "connection") << "\ndevices:\n";
      for (const auto& [device, info] : body["devices"].items())
        out << "  " << device << ": " << format_bytes(info["used"].get<uint64_t>()) << " of "
            << (info["budget"].is_null() ? std::string("no budget") : format_bytes(info["budget"].get<uint64_t>()))
            << (info.value("releasing", uint64_t{0}) ? ", " + format_bytes(info["releasing"].get<uint64_t>()) +
                                                          " of replaced values being freed" : "")
            << (info.value("shared", uint64_t{0}) ? ", " + format_bytes(info["shared"].get<uint64_t>()) +
                                                       " less for checkpoint pages models share" : "")
            << '\n';
      out << "models:" << (body["models"].empty() ? " none\n" : "\n");
      // Each model (what it holds now, and what it counts against the budgets above, which add up
      // to `used`), then what belongs to it: why it is not loaded, its plan, its leases.
      std::vector<std::vector<std::string>> rows = {{"NAME", "STATE", "VERSION", "HOLDS", "CHARGED"}};
      for (const auto& m : body["models"])
        rows.push_back({m["name"].get<std::string>(),
                        m["state"].get<std::string>() + (m["busy"].get<bool>() ? " (busy)" : "") +
                            (m.value("waiting_for_room", false) ? " (waiting for room)" : ""),
                        version_text(m), devices_text(m["devices"]), charge_text(m.value("charge", json::object()))});
      const auto lines = split_lines(format_table(rows, 2));
      if (!body["models"].empty()) out << lines[0] << '\n';
      for (size_t i = 0; i < body["models"].size(); ++i) {
        const json& m = body["models"][i];
        out << lines[i + 1] << '\n';
        if (m.contains("reason")) print_lines("", m["reason"].get<std::string>(), out);
        if (m.contains("weights")) out << "    " << m["weights"]["plan"].get<std::string>() << '\n';
        if (m.contains("views")) {
          const json& v = m["views"];
          std::string with;
          for (const auto& name : v["with"]) with += (with.empty() ? "" : ", ") + name.get<std::string>();
          const uint64_t copies = v.value("copies", uint64_t{0}), pages = v["bytes"].get<uint64_t>() - copies;
          std::string held = pages ? format_bytes(pages) + " are views of the checkpoint's pages" : "";
          if (copies) held += (held.empty() ? "" : ", ") + format_bytes(copies) + " are copies its configs can share";
          out << "    " << held
              << (with.empty() ? "" : ", " + format_bytes(v["shared"].get<uint64_t>()) + " of them shared with " + with)
              << '\n';
        }
        print_leases(m, out);
        for (const auto& kept : body.value("kept_memfds", json::array()))
          if (kept["model"] == m["name"]) {
            std::string locked;
            for (const auto& device : kept["page_locked"]) locked += (locked.empty() ? ", page-locked for " : ", ") +
                                                                     device.get<std::string>();
            out << "    updates from pid " << kept["pid"] << " through a kept memfd of "
                << format_bytes(kept["bytes"].get<uint64_t>()) << locked << '\n';
          }
      }
    } else {
      print_models(body["models"], out);
    }
    return 0;
  }

  if (command == "load") {
    add_query("stream", "true");
    ProgressView view(err, o.model, o.progress && !o.json);
    std::string pending;
    json last;
    const auto response = client.request("POST", model_path + "/load" + query, {}, [&](std::string_view chunk) {
      pending.append(chunk);
      for (size_t newline; (newline = pending.find('\n')) != std::string::npos;) {
        const std::string line = pending.substr(0, newline);
        pending.erase(0, newline + 1);
        if (line.empty()) continue;
        last = json::parse(line, nullptr, false);
        if (o.json) out << line << '\n';
        view.update(last);
      }
    });
    view.finish();
    if (!pending.empty()) {
      last = json::parse(pending, nullptr, false);
      if (o.json) out << pending;
    }
    if (response.status != 200) {
      err << "vramctl load: " << for_vramctl(last.is_object() && last.contains("error") ? last["error"].get<std::string>() : "HTTP " + std::to_string(response.status)) << '\n';
      return 1;
    }
    if (!last.is_object() || last.value("status", "") != "ready") {
      err << "vramctl load: " << for_vramctl(last.is_object() && last.contains("error") ? last["error"].get<std::string>() : "the load did not finish") << '\n';
      return 1;
    }
    if (!o.json)
      out << o.model << " ready: " << last["architecture"].get<std::string>() << ", " << last["dtype"].get<std::string>()
          << ", " << format_bytes(last["bytes"].get<uint64_t>()) << " on " << where_text(last["devices"], last["bytes"])
          << ", version " << version_text(last) << '\n';
    return 0;
  }

  if (command == "unload" || command == "offload" || command == "onload") {
    const auto response = client.request("POST", model_path + "/" + command + (o.wait ? "" : "?wait=false"));
    if (response.status != 200) return refused(response);
    if (o.json) return out << response.body, 0;
    const json body = parse_json(response);
    out << o.model << ": " << body["state"].get<std::string>();
    if (body.contains("moved"))
      out << " (moved " << format_bytes(body["moved"]["bytes"].get<uint64_t>()) << " in " << std::fixed
          << std::setprecision(3) << body["moved"]["seconds"].get<double>() << " s)" << std::defaultfloat;
    if (!body["devices"].empty()) out << "; weights on " << devices_text(body["devices"]);
    out << '\n';
    return 0;
  }

  if (command == "lease") {
    const auto lease = client.lease(o.model, o.device);
    if (o.json) {
      out << lease.manifest << std::endl;
    } else {
      const json manifest = json::parse(lease.manifest);
      std::string regions;
      for (const auto& region : manifest["regions"])
        regions += (regions.empty() ? "" : ", ") + region["kind"].get<std::string>() + " " +
                   format_bytes(region["size"].get<uint64_t>()) +
                   (region.contains("path") ? " " + region["path"].get<std::string>() : "");
      out << "lease " << manifest["lease"] << " of " << o.model << ": " << counted(manifest["tensors"].size(), "tensor") << ", "
          << format_bytes(manifest["bytes"].get<uint64_t>()) << " on " << manifest["device"].get<std::string>() << " in "
          << counted(manifest["regions"].size(), "region") << " (" << regions << ")" << std::endl;
    }
    std::vector<std::shared_ptr<cuda::VmmRegion>> mapped;  // GPU memory is mapped here, as a client would
    if (o.device != "cpu") {
      mapped = client::map_cuda_regions(lease);
      const bool read_only = std::all_of(mapped.begin(), mapped.end(), [](const auto& r) { return r->read_only(); });
      err << "mapped " << mapped.size() << " regions on " << o.device
          << (read_only ? " read-only" : " writable (the driver allows no read-only mapping)") << std::endl;
    }
    if (o.hold) {
      err << "holding the lease until standard input ends (Ctrl-D) or vramctl is stopped" << std::endl;
      char buffer[4096];
      while (::read(0, buffer, sizeof buffer) > 0) {
      }
    }
    return 0;
  }

  if (command == "update") {
    const auto response =
        o.body ? client.request("POST", model_path + "/weights",
                                read_regular_file(o.checkpoint, config::ServerLimits{}.max_body_bytes), {},
                                "application/octet-stream")
               : client.request("POST", model_path + "/weights",
                                json{{"path", std::filesystem::absolute(o.checkpoint).lexically_normal().string()}}.dump(),
                                {}, "application/json");
    if (response.status != 200) return refused(response);
    if (o.json) return out << response.body, 0;
    const json body = parse_json(response);
    const json& updated = body["updated"];
    out << o.model << ": version " << body["version"].get<uint64_t>() << " (" << counted(updated["tensors"].get<uint64_t>(), "tensor")
        << ", " << format_bytes(updated["bytes"].get<uint64_t>()) << " in " << std::fixed << std::setprecision(3)
        << updated["seconds"].get<double>() << " s)" << std::defaultfloat << '\n';
    return 0;
  }

  if (command == "lora") {
    if (o.clear == !o.adapters.empty()) throw Error("give the adapters as FILE[:SCALE] arguments, or --clear to remove them all");
    json loras = json::array();
    for (const std::string& given : o.adapters) {
      std::string path = given;
      double scale = 1.0;
      if (const size_t colon = given.rfind(':'); colon != std::string::npos) {
        const std::string number = given.substr(colon + 1);
        char* end = nullptr;
        const double parsed = std::strtod(number.c_str(), &end);
        if (!number.empty() && end == number.c_str() + number.size()) {
          if (!std::isfinite(parsed)) throw Error(quote(given) + ": the scale after ':' must be a finite number");
          path = given.substr(0, colon);
          scale = parsed;
        }
      }
      loras.push_back({{"path", std::filesystem::absolute(path).lexically_normal().string()}, {"scale", scale}});
    }
    const auto response = client.request("POST", model_path + "/loras", json{{"loras", loras}}.dump(), {}, "application/json");
    if (response.status != 200) return refused(response);
    if (o.json) return out << response.body, 0;
    const json body = parse_json(response);
    out << o.model << ": version " << body["version"].get<uint64_t>() << ", ";
    if (body["loras"].empty()) out << "no adapters";
    for (size_t i = 0; i < body["loras"].size(); ++i) {
      const json& a = body["loras"][i];
      out << (i ? "; " : "") << a["path"].get<std::string>() << " at scale " << a["scale"].get<double>() << " ("
          << a["format"].get<std::string>() << ", " << counted(a["modules"].get<uint64_t>(), "weight") << ", "
          << format_bytes(a["bytes"].get<uint64_t>()) << ")";
    }
    out << " (" << counted(body["updated"]["tensors"].get<uint64_t>(), "weight") << " written in " << std::fixed
        << std::setprecision(3) << body["updated"]["seconds"].get<double>() << " s)" << std::defaultfloat << '\n';
    return 0;
  }

  if (command == "forward") {
    if (o.input.empty() == o.values.empty()) throw Error("give the inputs either with --input FILE or as name=values arguments");
    const std::string body = o.input.empty() ? inputs_from_values(o.values)
                                             : read_regular_file(o.input, config::ServerLimits{}.max_body_bytes);
    const auto response = client.request("POST", model_path + "/forward" + query, body);
    if (response.status != 200) return refused(response);
    if (!o.output.empty()) {
      std::ofstream file(o.output, std::ios::binary);
      file.write(response.body.data(), static_cast<std::streamsize>(response.body.size()));
      if (!file) fail(o.output, "cannot write");
      err << "wrote the outputs to " << o.output << '\n';
      return 0;
    }
    if (o.json) return out << outputs_json(response.body).dump() << '\n', 0;
    print_tensors(response.body, out);
    return 0;
  }
  throw Error("unknown command " + command);
}

}  // namespace

int remote(const std::string& command, const RemoteOptions& o, std::ostream& out, std::ostream& err) {
  client::Client client(client::socket_path(o.socket, o.daemon_config));
  try {
    return run_remote(client, command, o, out, err);
  } catch (const nlohmann::json::exception&) {  // a field missing or of another type
    throw Error("the server at " + client.socket_path() + " answered `vramctl " + command +
                "` with JSON that is not what docs/api.md documents; is it a vramd of this version?");
  }
}

}  // namespace vramd::cli
