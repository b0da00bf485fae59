#include "server/status.hpp"

#include <ctime>

#include "config/units.hpp"
#include "server/budget.hpp"
#include "server/json_out.hpp"
#include "server/registry.hpp"
#include "util/clock.hpp"
#include "weights/copy_key.hpp"

namespace vramd::server {
using nlohmann::json;

const char* state_name(ModelState state) {
  switch (state) {
    case ModelState::Unloaded: return "unloaded";
    case ModelState::Loading: return "loading";
    case ModelState::Ready: return "ready";
    case ModelState::Offloaded: return "offloaded";
    case ModelState::Failed: return "failed";
    case ModelState::Invalid: return "invalid";
  }
  return "?";
}

namespace {

// `packed` for the states that can hold GGUF blocks packed: true, false or "auto".
json state_json(const config::DeviceState& state, const std::string& model_dtype, bool packable = true) {
  json j = {{"device", state.device.str()}, {"dtype", state.dtype ? config::dtype_str(state.dtype) : model_dtype}};
  if (packable) j["packed"] = state.packed ? json(*state.packed) : json("auto");
  return j;
}

// Every time the daemon shows: ISO 8601 in UTC, as 2026-12-01T20:32:17Z.
constexpr const char* kTimeFormat = "%Y-%m-%dT%H:%M:%SZ";

std::string clock_text(std::chrono::system_clock::time_point when, const char* format) {
  const std::time_t t = std::chrono::system_clock::to_time_t(when);
  std::tm parts{};
  ::gmtime_r(&t, &parts);
  char text[32];
  std::strftime(text, sizeof text, format, &parts);
  return text;
}

}  // namespace

json progress_json(const LoadProgress& p) {
  return {{"bytes_done", p.bytes_done}, {"bytes_total", p.bytes_total}, {"tensors_done", p.tensors_done},
          {"tensors_total", p.tensors_total}};
}

namespace {

template <class Sink>
void write_ints(Sink& out, std::string_view name, const std::vector<int64_t>& values) {
  out.key(name).array();
  for (const int64_t n : values) out.value(n);
  out.end();
}

template <class Sink>
void write_plan(Sink& out, const weights::ManagedPlan& plan) {
  out.object().field("device", plan.device).field("dtype", plan.dtype).field("limit", plan.limit).key("units").array();
  for (const auto& u : plan.units) {
    out.object().field("name", u.name).key("tensors").array();
    for (const auto& tensor : u.tensors) out.value(tensor);
    out.end().field("resting", u.resting).field("computed", u.computed).end();
  }
  out.end().end();
}

}  // namespace

std::string manifest_line(const weights::Manifest& manifest, const std::string& model, std::optional<uint64_t> lease) {
  std::string text;
  text.reserve(512 + 192 * manifest.tensors.size());
  JsonOut out(text);
  out.object().field("model", model).field("lease", lease).field("device", manifest.device).field("bytes", manifest.bytes)
      .field("version", manifest.version).key("regions").array();
  for (const auto& region : manifest.regions) {
    out.object().field("kind", region.kind).field("size", region.size);
    if (!region.path.empty()) out.field("path", region.path);
    out.end();
  }
  out.end().key("tensors").array();
  for (const auto& t : manifest.tensors) {
    out.object().field("name", t.name).field("dtype", t.dtype);
    write_ints(out, "shape", t.shape);
    write_ints(out, "strides", t.strides);
    out.field("region", t.region).field("offset", t.offset);
    if (!t.packed.empty()) {
      out.key("packed").object().field("type", t.packed);
      write_ints(out, "shape", t.unpacked_shape);
      out.end();
    }
    out.end();
  }
  out.end();
  if (manifest.plan) write_plan(out.key("plan"), *manifest.plan);
  if (manifest.loras) {
    out.key("loras").array();
    for (const auto& lora : *manifest.loras) out.object().field("path", lora.path).field("scale", lora.scale).end();
    out.end();
  }
  out.end();
  text += '\n';
  return text;
}

json plan_json(const weights::ManagedPlan& plan) {
  JsonTree tree;
  write_plan(tree, plan);
  return tree.take();
}

json dry_plan_json(const Entry& entry) {
  const model::DryRun& dry = *entry.dry;
  return {{"model", entry.name}, {"names", dry.names}, {"plan", dry.plan ? plan_json(*dry.plan) : json(nullptr)}};
}

std::string holders(const Entry& entry) {
  std::string text;
  for (const auto& [id, lease] : entry.leases)
    text += (text.empty() ? "" : ", ") + std::string("pid ") + std::to_string(lease.pid) + " (uid " + std::to_string(lease.uid) +
            ", " + lease.device + ", since " + clock_text(lease.since, kTimeFormat) + ")";
  return text;
}

namespace {

// The parts a model's entry and its status line share, written once for both sinks
// (server/json_out.hpp).

// [{"id", "pid", "uid", "device", "since", "reserved", "peak"}]
template <class Out>
void write_leases(Out& out, const Entry& e) {
  out.array();
  for (const auto& [id, lease] : e.leases) {
    out.object().field("id", lease.id).field("pid", lease.pid).field("uid", lease.uid).field("device", lease.device);
    out.field("since", clock_text(lease.since, kTimeFormat)).field("reserved", lease.reserved).field("peak", lease.peak).end();
  }
  out.end();
}

// What a model counts against each device's budget, by part (server/budget.hpp's charged):
// {"cpu": {"bytes": N, "parts": {"limit": N, "onload": N, ...}}}.
template <class Out>
void write_charge(Out& out, const Holdings& charge) {
  out.object();
  for (const auto& [device, parts] : charge) {
    uint64_t bytes = 0;
    for (const auto& [part, n] : parts) bytes += n;
    out.key(device).object().field("bytes", bytes).key("parts").object();
    for (const auto& [part, n] : parts) out.field(part, n);
    out.end().end();
  }
  out.end();
}

// The checkpoint's pages the model's weights view in host memory and the copies they share
// with other configs of the checkpoint (not empty), and which other models hold them too (each
// byte counted once in the cpu budget).
template <class Out>
void write_views(Out& out, const Entry& e) {
  uint64_t shared = 0;
  out.object().field("bytes", e.views.bytes()).field("copies", e.views.named(weights::kCopySpan).bytes());
  out.key("with").array();
  if (e.registry) {
    const std::vector<const Entry*>& all = e.registry->entries();
    for (const Entry* other : all)
      if (other != &e && e.views.overlap(other->views)) out.value(other->name);
    shared = viewed_by_others(e.views, all, &e);
  }
  out.end().field("shared", shared).end();
}

// One of those parts as a tree, for an entry.
template <class Write>
json tree_of(Write write) {
  JsonTree tree;
  write(tree);
  return tree.take();
}

}  // namespace

json entry_json(const Entry& e) {
  json j = {{"name", e.name}, {"state", state_name(e.state)}, {"file", e.file}, {"devices", e.bytes},
            {"charge", tree_of([&](JsonTree& t) { write_charge(t, charged(e)); })}, {"busy", e.busy},
            {"queued", e.queue.size()}};
  if (!e.derived_from.empty()) j["derived_from"] = e.derived_from;
  if (!e.reason.empty()) j["reason"] = e.reason;
  if (e.waiting_for_room) j["waiting_for_room"] = true;
  if (!e.config_error.empty()) j["config_error"] = e.config_error;
  if (e.config && e.dry) {
    const auto& c = *e.config;
    j["architecture"] = e.dry->architecture;
    j["dtype"] = e.dry->dtype;
    j["bytes"] = e.dry->report.bytes;
    j["tensors"] = e.dry->report.tensors;
    j["checkpoint"] = e.dry->report.checkpoint;
    if (!e.dry->report.warnings.empty()) j["warnings"] = e.dry->report.warnings;
    j["loras"] = json::array();
    for (const auto& a : e.dry->report.adapters)
      j["loras"].push_back({{"path", a.path}, {"scale", a.scale}, {"format", a.format}, {"modules", a.modules}, {"bytes", a.bytes}});
    // A state of dtype "auto" is in the model's dtype, which the dry run has settled.
    const std::string& dtype = e.dry->dtype;
    j["vram"] = {{"offload", state_json(c.vram.offload, dtype)}, {"onload", state_json(c.vram.onload, dtype)},
                 {"preparing", state_json(c.vram.preparing, dtype)}, {"computation", state_json(c.vram.computation, dtype, false)},
                 {"limit", c.vram.limit ? json(*c.vram.limit) : json(nullptr)},
                 {"onload_limit", c.vram.onload_limit ? json(*c.vram.onload_limit) : json(nullptr)},
                 {"direct_io", c.vram.direct_io ? json(*c.vram.direct_io) : json("auto")}};
    j["residency"] = {{"keep_alive", config::format_duration(e.keep_alive)}, {"pinned", c.residency.pinned},
                      {"preload", c.residency.preload}};
  }
  if (e.vram && e.runtime) j["weights"] = *e.vram;
  if (!e.views.empty()) j["views"] = tree_of([&](JsonTree& t) { write_views(t, e); });
  j["version"] = e.runtime ? json(e.version) : json(nullptr);
  j["leases"] = tree_of([&](JsonTree& t) { write_leases(t, e); });
  if (e.state == ModelState::Loading) j["progress"] = progress_json(e.progress);
  j["idle_seconds"] = e.last_used == Clock::time_point{} ? json(nullptr) : json(seconds_since(e.last_used));
  j["stats"] = {{"loads", e.loads}, {"load_seconds", e.load_seconds}, {"forwards", e.forwards},
                {"forward_errors", e.forward_errors}, {"forwards_cancelled", e.forwards_cancelled},
                {"forward_seconds", e.forward_seconds}, {"updates", e.updates}, {"update_seconds", e.update_seconds}};
  return j;
}

void write_summary(JsonOut& out, const Entry& e, const Holdings& charge) {
  out.object().field("name", e.name).field("state", state_name(e.state)).key("devices").object();
  for (const auto& [device, bytes] : e.bytes) out.field(device, bytes);
  out.end().key("charge");
  write_charge(out, charge);
  out.field("busy", e.busy).field("queued", e.queue.size()).key("vram");
  if (e.config)
    out.object().field("computation", e.config->vram.computation.device.str())
        .field("offload", e.config->vram.offload.device.str()).end();
  else
    out.value(nullptr);
  if (e.waiting_for_room) out.field("waiting_for_room", true);
  if (!e.reason.empty()) out.field("reason", e.reason);
  out.key("version");
  if (e.runtime) out.value(e.version);
  else out.value(nullptr);
  write_leases(out.key("leases"), e);
  if (e.vram && e.runtime) out.field("weights", json(*e.vram));
  if (!e.views.empty()) write_views(out.key("views"), e);
  out.end();
}

void write_devices(JsonOut& out, const std::map<std::string, DeviceUse>& devices) {
  out.object();
  for (const auto& [device, d] : devices) {
    out.key(device).object().field("budget", d.budget).field("used", d.used).field("releasing", d.releasing);
    out.field("shared", d.shared).key("models").object();
    for (const auto& [name, bytes] : d.models) out.field(name, bytes);
    out.end().end();
  }
  out.end();
}

}  // namespace vramd::server
