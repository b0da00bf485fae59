#include "server/daemon.hpp"

#include <cmath>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "config/units.hpp"
#include "server/boundary.hpp"
#include "server/http.hpp"
#include "server/registry.hpp"
#include "server/reply.hpp"
#include "server/routes.hpp"
#include "server/status.hpp"
#include "storage/mapping.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/log.hpp"
#include "util/torch_cuda.hpp"
#include "util/utf8.hpp"

namespace vramd::server {
namespace {

using nlohmann::json;

// A label value as Prometheus' text format writes one. A valid config's name needs nothing, but
// an invalid one is known by its escaped file name, which may hold '\\', '"' or '}'.
std::string label(std::string_view value) {
  std::string out;
  for (const char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    out += c == '\n' ? std::string("\\n") : std::string(1, c);
  }
  return out;
}

class Daemon {
 public:
  explicit Daemon(const config::DaemonConfig& config)
      : config_(config),
        server_(uv_default_loop(), config.limits, access(config), [this](std::shared_ptr<Exchange> e) { handle(std::move(e)); }),
        registry_(uv_default_loop(), config) {}

  int run() {
    uv_loop_t* loop = uv_default_loop();
    // Before the socket appears: a client may stop the daemon as soon as it connects, and the
    // stop, run once the loop runs, removes the socket.
    for (auto* signal : {&sigterm_, &sigint_}) {
      uv_signal_init(loop, signal);
      signal->data = this;
      uv_signal_start(signal, [](uv_signal_t* s, int number) {
                        guarded("stopping", [&] { static_cast<Daemon*>(s->data)->stop(number); });
                      },
                      signal == &sigterm_ ? SIGTERM : SIGINT);
    }
    // Then: a second daemon must not load anything.
    const auto activated = activated_socket();
    if (activated) server_.listen_activated(*activated, config_.socket);
    else server_.listen_unix(config_.socket);
    if (!config_.tcp.empty()) server_.listen_tcp(config_.tcp);
    registry_.start();  // clients are accepted once the loop runs, after every config is known
    log::info("vramd " + std::string(VRAMD_VERSION) + " serving on " + config_.socket + (activated ? " (from systemd)" : "") +
              (config_.tcp.empty() ? "" : " and tcp " + config_.tcp) + " (pid " + std::to_string(::getpid()) + ")");
    const std::string& no_cuda = torch_cuda::missing();
    log::info(no_cuda.empty() ? "CUDA devices can be used" : "models compute on the CPU only: " + no_cuda);
    uv_timer_init(loop, &timer_);
    timer_.data = this;
    uv_run(loop, UV_RUN_DEFAULT);
    log::info("stopped");
    return 0;
  }

 private:
  static Access access(const config::DaemonConfig& config) {
    Access access;
    access.owner = ::geteuid();
    access.uids = config.access.uids;
    if (!config.access.group.empty()) access.group = config.access.gid;
    return access;
  }

  // SIGTERM, SIGINT: stop accepting, refuse what is queued, cancel loads, let forwards end
  // within the grace period, then stop them before their next layer.
  void stop(int number) {
    if (stopping_) return;
    stopping_ = true;
    stop_started_ = std::chrono::steady_clock::now();
    log::info(std::string(number == SIGTERM ? "SIGTERM" : "SIGINT") + ": stopping (grace " +
              config::format_duration(config_.limits.shutdown_grace) + ")");
    server_.stop_listening();
    registry_.begin_shutdown();
    uv_timer_start(&timer_, [](uv_timer_t* t) { guarded("stopping", [&] { static_cast<Daemon*>(t->data)->poll_stop(); }); }, 0, 20);
  }

  void poll_stop() {
    server_.close_idle();
    const bool done = registry_.idle() && server_.exchanges_in_flight() == 0;
    if (!done) {
      const auto waited = std::chrono::steady_clock::now() - stop_started_;
      if (waited < config_.limits.shutdown_grace) return;
      if (!forwards_stopped_) {
        forwards_stopped_ = true;
        if (const size_t n = registry_.stop_forwards())
          log::warn("grace period over: stopping " + std::to_string(n) + " forward(s) before their next layer");
      }
      if (waited < config_.limits.shutdown_grace + kStopWait) return;
      log::warn("work still in flight after the grace period: exiting without waiting for it");
      std::fflush(stderr);
      std::_Exit(0);
    }
    server_.close_all();
    registry_.close();
    uv_close(reinterpret_cast<uv_handle_t*>(&timer_), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&sigterm_), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&sigint_), nullptr);
  }

  void handle(std::shared_ptr<Exchange> exchange) {
    const Request& request = exchange->request();
    if (log::enabled(log::Level::Debug)) log::debug(request.peer + ": " + request.method + " " + quote(request.path));
    const Route route = server::route(request);
    requests_[route.endpoint]++;
    switch (route.kind) {
      case Route::Kind::Refused: return respond_error(*exchange, route.status, route.error);
      case Route::Kind::Metrics: return exchange->respond(200, "text/plain; version=0.0.4", metrics());
      case Route::Kind::Health:
        return respond_json(*exchange, 200, {{"status", "ok"}, {"version", VRAMD_VERSION}, {"pid", pid_}});
      case Route::Kind::Status: return exchange->respond(200, "application/json", status());
      case Route::Kind::Reload: return registry_.scan(true, [this, exchange] { respond_json(*exchange, 200, models()); });
      case Route::Kind::List: return respond_json(*exchange, 200, models());
      case Route::Kind::Model:
      case Route::Kind::Remove:
      case Route::Kind::Action: break;
    }
    Entry* entry = registry_.find(route.model);
    if (!entry) return respond_error(*exchange, 404, "no model named " + quote(route.model) + "; GET /v1/models lists them");
    if (route.kind == Route::Kind::Model) return respond_json(*exchange, 200, entry_json(*entry));
    if (route.kind == Route::Kind::Remove) return registry_.remove(*entry, exchange);
    if (route.action == "plan") {  // from the config's dry run: nothing is loaded or held
      if (entry->removed) return respond_error(*exchange, 404, "model " + quote(entry->name) + " was removed");
      if (!entry->config || !entry->dry)
        return respond_error(*exchange, 409, "model " + quote(entry->name) + " is invalid: " + entry->reason);
      return respond_json(*exchange, 200, dry_plan_json(*entry));
    }
    if (route.action == "derive") {
      // POST .../derive: {"converter": "<a Lua converter's text>"}.
      const json body = json::parse(request.body, nullptr, false);
      if (!body.is_object() || body.size() != 1 || !body.contains("converter") || !body["converter"].is_string())
        return respond_error(*exchange, 400, "derive: expected {\"converter\": \"<a Lua converter's text>\"}");
      return registry_.derive(*entry, body["converter"].get<std::string>(),
                              [exchange](int status, const json& answer) { respond_json(*exchange, status, answer); });
    }

    static const std::map<std::string, Job::Kind> actions = {
        {"load", Job::Kind::Load},       {"unload", Job::Kind::Unload}, {"offload", Job::Kind::Offload},
        {"onload", Job::Kind::Onload},   {"forward", Job::Kind::Forward}, {"lease", Job::Kind::Lease},
        {"weights", Job::Kind::Update}, {"loras", Job::Kind::Update}};
    Job job(actions.at(route.action), exchange);
    if (auto it = request.query.find("wait"); it != request.query.end()) {
      if (job.kind != Job::Kind::Unload && job.kind != Job::Kind::Offload && job.kind != Job::Kind::Lease)
        return respond_error(*exchange, 400, "wait= applies to unload, offload and lease, not " + route.action);
      if (it->second != "true" && it->second != "false")
        return respond_error(*exchange, 400, "wait=" + escape_invalid_utf8(it->second) + ": expected true or false");
      job.wait = it->second == "true";
    }
    if (job.kind == Job::Kind::Lease) {
      try {
        read_lease_request(request, job);
      } catch (const Error& e) {
        return respond_error(*exchange, 400, e.what());
      }
      if (job.hold && request.peer_pid < 0)
        return respond_error(*exchange, 400, "a lease hands over file descriptors, which only the Unix socket carries; "
                                             "GET " + escape_invalid_utf8(request.path) + " shows the manifest alone");
      if (!job.wait && (entry->state != ModelState::Ready || entry->busy || !entry->queue.empty()))
        return respond_error(*exchange, 409, "model " + quote(entry->name) + " is " + state_name(entry->state) +
                                                 (entry->busy ? " and busy" : "") + "; leave out wait=false to load or wait for it");
    }
    if (auto it = request.query.find("keep_alive"); it != request.query.end()) {
      try {
        entry->keep_alive = config::parse_duration(it->second);  // until the config changes
      } catch (const Error& e) {
        return respond_error(*exchange, 400, "keep_alive=" + escape_invalid_utf8(it->second) + ": " + e.what());
      }
    }
    if (auto it = request.query.find("stream"); it != request.query.end() && job.kind == Job::Kind::Load)
      job.stream = it->second.empty() || it->second == "true" || it->second == "1";
    if (job.kind == Job::Kind::Forward) {
      if (request.body.empty())
        return respond_error(*exchange, 400, "forward needs a request body: the inputs as a safetensors file");
      job.input = std::move(const_cast<Request&>(request).body);
    }
    if (route.action == "loras") {
      try {
        job.loras = read_loras_request(request);
      } catch (const Error& e) {
        return respond_error(*exchange, 400, e.what());
      }
    } else if (job.kind == Job::Kind::Update) {
      bool keep = false;
      try {
        keep = read_update_request(const_cast<Request&>(request), job);
      } catch (const Error& e) {
        return respond_error(*exchange, 400, e.what());
      }
      // One kept memfd per model and connection: an update without keep lets it go.
      auto& held = exchange->held("kept memfd of " + entry->name);
      if (!keep) held.reset();
      else if (!held) {
        held = std::shared_ptr<KeptMemfd>(new KeptMemfd(entry->name, request.peer_pid),
                                          [this](KeptMemfd* kept) { dropper_.run([kept] { delete kept; }); });
        std::erase_if(kept_, [](const auto& weak) { return weak.expired(); });
        kept_.push_back(std::static_pointer_cast<KeptMemfd>(held));
        std::erase_if(entry->kept, [](const auto& weak) { return weak.expired(); });
        entry->kept.push_back(std::static_pointer_cast<KeptMemfd>(held));
      }
      job.kept = std::static_pointer_cast<KeptMemfd>(held);
    }
    registry_.submit(*entry, std::move(job));
  }

  // POST .../loras: {"loras": [{"path": "/abs/adapter", "scale": 1.0}, ...]}, [] for none.
  static std::vector<config::LoraConfig> read_loras_request(const Request& request) {
    const json body = json::parse(request.body, nullptr, false);
    const char* shape = "loras: expected {\"loras\": [{\"path\": \"/abs/adapter\", \"scale\": 1.0}, ...]}";
    if (!body.is_object() || !body.contains("loras") || !body["loras"].is_array() || body.size() != 1) throw Error(shape);
    std::vector<config::LoraConfig> loras;
    for (size_t i = 0; i < body["loras"].size(); ++i) {
      const json& item = body["loras"][i];
      const std::string at = "loras[" + std::to_string(i) + "]";
      if (!item.is_object() || !item.contains("path") || !item["path"].is_string()) throw Error(at + ": " + shape);
      for (const auto& [key, value] : item.items())
        if (key != "path" && key != "scale") throw Error(at + ": unknown key " + quote(key) + " (path, scale)");
      config::LoraConfig lora{item["path"].get<std::string>(), 1.0};
      if (lora.path.empty() || lora.path[0] != '/')
        throw Error(at + ".path " + quote(lora.path) + " is not absolute: the daemon reads it from its own folder");
      if (item.contains("scale")) {
        if (!item["scale"].is_number() || !std::isfinite(item["scale"].get<double>()))
          throw Error(at + ".scale: expected a number");
        lora.scale = item["scale"].get<double>();
      }
      loras.push_back(std::move(lora));
    }
    return loras;
  }

  // POST .../weights: the new values as a safetensors body, or a JSON object (Content-Type:
  // application/json) {"path": "/abs/ckpt"} naming a checkpoint the daemon reads, or {"fd": N}
  // naming the client's sealed memfd, which the daemon opens as /proc/PID/fd/N; with
  // "keep": true, one the daemon keeps for the connection. Returns whether it keeps it.
  static bool read_update_request(Request& request, Job& job) {
    const std::string* type = request.header("content-type");
    if (type && type->starts_with("application/json")) {
      json body = json::parse(request.body, nullptr, false);
      bool keep = false;
      if (body.is_object() && body.contains("keep")) {
        if (!body["keep"].is_boolean() || !body.contains("fd"))
          throw Error("update: keep must be true or false, beside {\"fd\": N}: the daemon keeps a memfd its client "
                      "writes the next updates into");
        keep = body["keep"].get<bool>();
        body.erase("keep");
      }
      const bool path = body.is_object() && body.size() == 1 && body.contains("path") && body["path"].is_string();
      const bool fd = body.is_object() && body.size() == 1 && body.contains("fd") && body["fd"].is_number_unsigned();
      if (!path && !fd)
        throw Error("update: a JSON body must be {\"path\": \"/absolute/checkpoint\"} or {\"fd\": N} (a sealed memfd of "
                    "yours; \"keep\": true beside it keeps it for the next updates); the tensors themselves go as a "
                    "safetensors body (Content-Type: application/octet-stream)");
      if (fd) {
        if (request.peer_pid < 0)
          throw Error("update: {\"fd\": N} names a descriptor of the client's process, which only the Unix socket tells");
        job.memfd = "/proc/" + std::to_string(request.peer_pid) + "/fd/" + std::to_string(body["fd"].get<uint64_t>());
        return keep;
      }
      job.path = body["path"].get<std::string>();
      if (!job.path.starts_with("/"))
        throw Error("update: path " + quote(job.path) + " is relative; give it whole (the daemon's folder is not yours)");
      return false;
    }
    if (request.body.empty())
      throw Error("update needs a request body: the new values as a safetensors file, or {\"path\": ...} as JSON");
    job.input = std::move(request.body);
    return false;
  }

  // POST .../lease: an optional JSON object {"device": "cpu", "wait": true, "follow": false,
  // "in_place": false, "adapters": false, "reserve": {"device": "cuda:0", "bytes": N}}; GET: the
  // manifest alone (?device=cpu&adapters=true).
  static void read_lease_request(const Request& request, Job& job) {
    job.hold = request.method == "POST";
    if (auto it = request.query.find("device"); it != request.query.end()) job.device = it->second;
    if (auto it = request.query.find("adapters"); it != request.query.end()) {
      if (it->second != "true" && it->second != "false")
        throw Error("lease: adapters=" + quote(it->second) + ": expected true or false");
      job.adapters = it->second == "true";
    }
    if (request.body.empty()) return;
    const json body = json::parse(request.body, nullptr, false);
    if (!body.is_object()) throw Error("a lease's body must be a JSON object such as {\"device\": \"cpu\"}");
    for (const auto& [key, value] : body.items()) {
      if (key == "device" && value.is_string()) job.device = value.get<std::string>();
      else if (key == "wait" && value.is_boolean()) job.wait = value.get<bool>();
      else if (key == "follow" && value.is_boolean()) job.follow = value.get<bool>();
      else if (key == "in_place" && value.is_boolean()) job.in_place = value.get<bool>();
      else if (key == "adapters" && value.is_boolean()) job.adapters = value.get<bool>();
      else if (key == "device" || key == "wait" || key == "follow" || key == "in_place" || key == "adapters")
        throw Error("lease: " + key + " must be a " + (key == "device" ? "string" : "boolean"));
      else if (key == "reserve") read_reservation(value, job);
      else throw Error("lease: unknown key " + quote(key) + " (device, wait, follow, in_place, adapters, reserve)");
    }
    if (!job.hold && (job.follow || job.in_place))
      throw Error(std::string("lease: ") + (job.in_place ? "in_place" : "follow") +
                  " sends each new version on the lease's connection, and GET holds none: POST it");
    if (job.in_place && !job.device.starts_with("cuda:"))
      throw Error("lease: in_place writes updates into the GPU memory a lease shares, and " + quote(job.device) +
                  " is not a GPU (host memory is sealed, never written under a client): lease on cuda:N, or follow "
                  "updates with follow");
    if (job.in_place && body.contains("follow") && !job.follow)
      throw Error("lease: in_place follows updates: leave out follow=false");
    job.follow = job.follow || job.in_place;
    if (!job.hold && !job.reserve.empty())
      throw Error("lease: reserve holds room for as long as a lease is held, and GET holds none: POST it");
  }

  // {"device": "cuda:0", "bytes": N}: what a managed client will use on a device, held in its budget.
  static void read_reservation(const json& value, Job& job) {
    const auto device = value.is_object() && value.contains("device") && value["device"].is_string()
                            ? config::Device::parse(value["device"].get<std::string>())
                            : std::nullopt;
    if (!device || device->is_disk() || !value.contains("bytes") || !value["bytes"].is_number_unsigned() ||
        value.size() != 2)
      throw Error("lease: reserve must be {\"device\": \"cpu\" or \"cuda:N\", \"bytes\": a whole number}");
    job.reserve = {{device->str(), value["bytes"].get<uint64_t>()}};
  }

  // Calls `each(memfd, held)` for each memfd connections keep for their clients' updates that
  // holds bytes mapped (`held`: what, and the GPUs it is page-locked for).
  template <class Each>
  void each_kept_memfd(Each each) const {
    for (const auto& weak : kept_) {
      const auto kept = weak.lock();
      if (!kept) continue;
      const auto held = kept->held();
      if (held.bytes) each(*kept, held);
    }
  }

  json models() const {
    json list = json::array();
    for (const Entry* entry : registry_.entries()) list.push_back(entry_json(*entry));
    return {{"models", std::move(list)}};
  }

  // Written as text, not built as a tree first: it is the request asked most often.
  std::string status() const {
    const auto charges = registry_.charges();  // each counted once, for its model and the devices
    std::string text;
    text.reserve(1024);  // one model's status is about 400 bytes
    JsonOut out(text);
    out.object().field("version", VRAMD_VERSION).field("pid", pid_);
    out.field("uptime_seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
    out.field("socket", config_.socket).key("devices");
    write_devices(out, registry_.devices(charges));
    out.key("models").array();
    for (const Entry* e : registry_.entries()) write_summary(out, *e, charges.at(e->name));
    out.end().field("connections", server_.connections()).key("kept_memfds").array();
    each_kept_memfd([&](const auto& kept, const auto& held) {
      out.object().field("model", kept.model).field("pid", kept.pid).field("bytes", held.bytes).key("page_locked").array();
      for (const auto& device : held.page_locked) out.value(device);
      out.end().end();
    });
    out.end().end();
    text += '\n';
    return text;
  }

  std::string metrics() const {
    std::ostringstream out;
    out << "# HELP vramd_requests_total Requests received, by endpoint.\n# TYPE vramd_requests_total counter\n";
    for (const auto& [endpoint, count] : requests_) out << "vramd_requests_total{endpoint=\"" << endpoint << "\"} " << count << '\n';
    out << "# HELP vramd_connections Open client connections.\n# TYPE vramd_connections gauge\nvramd_connections "
        << server_.connections() << '\n';
    out << "# HELP vramd_device_bytes Bytes of weights held per device.\n# TYPE vramd_device_bytes gauge\n";
    const auto devices = registry_.devices(registry_.charges());
    for (const auto& [device, d] : devices) out << "vramd_device_bytes{device=\"" << device << "\"} " << d.used << '\n';
    out << "# HELP vramd_device_budget_bytes The daemon's budget per device.\n# TYPE vramd_device_budget_bytes gauge\n";
    for (const auto& [device, d] : devices)
      if (d.budget) out << "vramd_device_budget_bytes{device=\"" << device << "\"} " << *d.budget << '\n';
    out << "# HELP vramd_model_state 1 for the state each model is in.\n# TYPE vramd_model_state gauge\n";
    for (const Entry* e : registry_.entries())
      out << "vramd_model_state{model=\"" << label(e->name) << "\",state=\"" << state_name(e->state) << "\"} 1\n";
    out << "# HELP vramd_forwards_total Forwards answered, by model.\n# TYPE vramd_forwards_total counter\n";
    for (const Entry* e : registry_.entries()) out << "vramd_forwards_total{model=\"" << label(e->name) << "\"} " << e->forwards << '\n';
    out << "# HELP vramd_forward_errors_total Forwards refused or failed, by model.\n# TYPE vramd_forward_errors_total counter\n";
    for (const Entry* e : registry_.entries())
      out << "vramd_forward_errors_total{model=\"" << label(e->name) << "\"} " << e->forward_errors << '\n';
    out << "# HELP vramd_forwards_cancelled_total Forwards stopped early (client gone, shutdown grace over), by model.\n"
           "# TYPE vramd_forwards_cancelled_total counter\n";
    for (const Entry* e : registry_.entries())
      out << "vramd_forwards_cancelled_total{model=\"" << label(e->name) << "\"} " << e->forwards_cancelled << '\n';
    out << "# HELP vramd_forward_seconds_total Time spent in forwards, by model.\n# TYPE vramd_forward_seconds_total counter\n";
    for (const Entry* e : registry_.entries())
      out << "vramd_forward_seconds_total{model=\"" << label(e->name) << "\"} " << e->forward_seconds << '\n';
    out << "# HELP vramd_loads_total Loads completed, by model.\n# TYPE vramd_loads_total counter\n";
    for (const Entry* e : registry_.entries()) out << "vramd_loads_total{model=\"" << label(e->name) << "\"} " << e->loads << '\n';
    out << "# HELP vramd_updates_total Weight updates applied, by model.\n# TYPE vramd_updates_total counter\n";
    for (const Entry* e : registry_.entries()) out << "vramd_updates_total{model=\"" << label(e->name) << "\"} " << e->updates << '\n';
    // A mixture of experts' counters, for the models that have experts.
    const auto experts = [&](const char* name, const char* help, auto count) {
      out << "# HELP " << name << ' ' << help << ", by model.\n# TYPE " << name << " counter\n";
      for (const Entry* e : registry_.entries())
        if (e->vram && e->vram->expert_slots) out << name << "{model=\"" << label(e->name) << "\"} " << count(*e->vram) << '\n';
    };
    experts("vramd_expert_hits_total", "Ops of experts' layers that found them resident",
            [](const model::VramStats& v) { return v.expert_hits; });
    experts("vramd_expert_misses_total", "Ops of experts' layers that brought them in",
            [](const model::VramStats& v) { return v.expert_misses; });
    experts("vramd_expert_bytes_streamed_total", "Bytes of experts' layers brought in",
            [](const model::VramStats& v) { return v.expert_bytes_streamed; });
    out << "# HELP vramd_lease_reserved_bytes Room a lease holds for its client on a device, by model, pid and device.\n"
           "# TYPE vramd_lease_reserved_bytes gauge\n";
    for (const Entry* e : registry_.entries())
      for (const auto& [id, lease] : e->leases)
        for (const auto& [device, bytes] : lease.reserved)
          out << "vramd_lease_reserved_bytes{model=\"" << label(e->name) << "\",pid=\"" << lease.pid << "\",device=\""
              << device << "\"} " << bytes << '\n';
    out << "# HELP vramd_lease_peak_bytes The most a lease's client says it has used of its room, by model and pid.\n"
           "# TYPE vramd_lease_peak_bytes gauge\n";
    for (const Entry* e : registry_.entries())
      for (const auto& [id, lease] : e->leases)
        if (lease.peak)
          out << "vramd_lease_peak_bytes{model=\"" << label(e->name) << "\",pid=\"" << lease.pid << "\"} " << *lease.peak << '\n';
    out << "# HELP vramd_kept_memfd_bytes Bytes of memfds the daemon keeps mapped for clients' updates, by model and "
           "pid.\n# TYPE vramd_kept_memfd_bytes gauge\n";
    each_kept_memfd([&](const auto& kept, const auto& held) {
      out << "vramd_kept_memfd_bytes{model=\"" << label(kept.model) << "\",pid=\"" << kept.pid << "\"} " << held.bytes << '\n';
    });
    return out.str();
  }

  config::DaemonConfig config_;
  // Frees what connections keep for their clients (an update's kept memfd: unpinning and
  // unmapping gigabytes takes a while) off the loop. Declared before server_, so it outlives
  // every connection.
  Worker dropper_{"vramd-drop-fd"};
  std::vector<std::weak_ptr<KeptMemfd>> kept_;  // what connections keep, for status (expired ones pruned as more come)
  Server server_;
  Registry registry_;
  uv_signal_t sigterm_{}, sigint_{};
  uv_timer_t timer_{};
  // After the grace period, how long forwards asked to stop have to do so before vramd exits anyway.
  static constexpr std::chrono::seconds kStopWait{10};
  bool stopping_ = false, forwards_stopped_ = false;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now(), stop_started_;
  const pid_t pid_ = ::getpid();  // asked once: glibc does not cache it, and status answers it each time
  std::map<std::string, uint64_t> requests_;
};

}  // namespace

int serve(const config::DaemonConfig& config) {
  std::signal(SIGPIPE, SIG_IGN);
  storage::survive_cut_files();  // Runtime checks every model's mappings after reading through them
  log::set_level(config.log_level);
  if (!config.log_file.empty()) log::open_file(config.log_file);
  Daemon daemon(config);
  return daemon.run();
}

}  // namespace vramd::server
