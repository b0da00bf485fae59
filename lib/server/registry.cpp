#include "server/registry.hpp"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "server/boundary.hpp"
#include "server/budget.hpp"
#include "server/leases.hpp"
#include "server/eviction.hpp"
#include "server/reply.hpp"
#include "server/status.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/log.hpp"
#include "util/utf8.hpp"

namespace vramd::server {
namespace fs = std::filesystem;
using nlohmann::json;

Registry::Registry(uv_loop_t* loop, const config::DaemonConfig& config)
    : loop_(loop), config_(config), mailbox_(loop) {}

Registry::~Registry() = default;

void Registry::start() {
  auto found = examine_folder(config_, {}, false);
  if (found.empty()) log::warn("no model configs (*.toml) in " + escape_invalid_utf8(config_.models));
  for (auto& v : found) apply(std::move(v));

  std::error_code ec;
  if (!fs::is_directory(config_.models, ec)) return;
  watcher_ = new uv_fs_event_t;
  debounce_ = new uv_timer_t;
  uv_fs_event_init(loop_, watcher_);
  uv_timer_init(loop_, debounce_);
  watcher_->data = debounce_->data = this;
  uv_fs_event_start(
      watcher_,
      [](uv_fs_event_t* handle, const char*, int, int) {
        auto* self = static_cast<Registry*>(handle->data);
        // Editors write a file in several steps: look once things have settled.
        uv_timer_start(self->debounce_, [](uv_timer_t* t) {
          guarded("scanning the model folder", [&] { static_cast<Registry*>(t->data)->scan(false); });
        }, 200, 0);
      },
      config_.models.c_str(), 0);
}

void Registry::scan(bool force, std::function<void()> done) {
  if (shutting_down_) {
    if (done) done();
    return;
  }
  // The folder is listed and read on the validator's thread, never here: a file may be slow,
  // or not a file at all.
  ConfigTexts known;
  for (auto& [name, entry] : entries_)
    if (!entry->removed && entry->derived_from.empty()) known[entry->file] = entry->text;
  ++validations_in_flight_;
  if (done) scan_done_.push_back(std::move(done));
  validator_.run([this, force, known = std::move(known), daemon = config_] {
    auto found = std::make_shared<std::vector<ConfigFile>>(examine_folder(daemon, known, !force));
    mailbox_.post([this, found] {
      for (auto& v : *found) apply(std::move(v));
      if (--validations_in_flight_ == 0)
        for (auto& callback : std::exchange(scan_done_, {})) callback();
    });
  });
}

Entry* Registry::find(const std::string& name) {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : it->second.get();
}

void Registry::relist() {
  listed_.clear();
  for (const auto& [name, entry] : entries_) listed_.push_back(entry.get());
}

Entry& Registry::add_entry(const std::string& name) {
  auto entry = std::make_unique<Entry>();
  entry->registry = this;
  entry->name = name;
  entry->keep_alive_timer = new uv_timer_t;
  uv_timer_init(loop_, entry->keep_alive_timer);
  entry->keep_alive_timer->data = entry.get();
  Entry& added = *(entries_[name] = std::move(entry));
  relist();
  return added;
}

void Registry::drop_entry(Entry& entry) {
  const std::string why = !entry.derived_from.empty() && !entry.removal_watchers.empty() ? "a DELETE asked for it"
                          : entry.derived_from.empty() ? entry.file + " is gone"
                                                       : "the config of " + quote(entry.derived_from) + ", which it is derived from, changed or went";
  for (auto& job : entry.queue) answer(job, 404, {{"error", "model " + quote(entry.name) + " was removed (" + why + ")"}});
  std::error_code ec;
  if (!entry.derived_from.empty() && entry.config) fs::remove(entry.config->converter, ec);
  uv_close(reinterpret_cast<uv_handle_t*>(entry.keep_alive_timer), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
  log::info("removed " + entry.name);
  const json removed = {{"name", entry.name}, {"state", "removed"}};
  const auto watchers = std::move(entry.removal_watchers);
  entries_.erase(entry.name);
  relist();
  for (const auto& watcher : watchers) {  // once it is gone, its converter's file too
    Job asked(Job::Kind::Unload, watcher);
    answer(asked, 200, removed);
  }
  if (std::exchange(rescan_after_drop_, false)) scan(false);
}

void Registry::apply(ConfigFile v) {
  if (shutting_down_) return;
  Entry* current = nullptr;
  for (auto& [name, entry] : entries_)
    if (entry->file == v.file && !entry->removed && entry->derived_from.empty()) current = entry.get();
  if (current && (!v.exists || v.text != current->serving_text)) retire_derived(*current);

  if (!v.exists) {
    if (!current) return;
    current->removed = true;
    if (current->busy || current->runtime) return submit(*current, Job(Job::Kind::Unload));
    return drop_entry(*current);
  }

  if (v.config) {
    const std::string name = v.config->name;
    Entry* same = find(name);
    if (same && same->removed) {  // its old file is still being unloaded: look again after
      rescan_after_drop_ = true;
      return;
    }
    if (same && same->file != v.file) {
      v.error = v.file + ": name " + quote(name) + " is already used by " +
                (same->derived_from.empty() ? same->file : "a model derived from " + quote(same->derived_from));
    } else {
      if (current && current->name != name) {
        apply(ConfigFile::gone(v.file));
        return apply(std::move(v));
      }
      if (current && v.text == current->serving_text && current->config) {
        current->text = v.text;
        current->config_error.clear();
        current->replacement.reset();  // an edit taken back: a queued replacement keeps this version
        return;
      }
      if (current && (current->busy || current->runtime)) {
        if (current->replacement && v.text == current->text) return;  // this edit is already queued
        log::info(name + ": " + v.file + " changed; the new version takes over once the work in flight ends");
        current->text = v.text;
        current->config_error.clear();
        // One replacement queued at a time: it takes whichever version is newest when it runs.
        const bool queued = current->replacement.has_value();
        current->replacement.emplace(std::move(*v.config), std::move(*v.dry));
        if (!queued) submit(*current, Job(Job::Kind::Replace));
        return;
      }
      Entry& entry = current ? *current : add_entry(name);
      entry.file = v.file;
      entry.text = entry.serving_text = v.text;
      entry.config = std::move(v.config);
      entry.dry = std::move(v.dry);
      entry.keep_alive = entry.config->residency.keep_alive;
      entry.state = ModelState::Unloaded;
      entry.reason.clear();
      entry.config_error.clear();
      log::info("valid " + name + ": " + entry.dry->architecture + ", " + entry.dry->dtype + ", " +
                format_bytes(entry.dry->report.bytes) + " (" + v.file + ")");
      for (const auto& warning : entry.dry->report.warnings) log::warn(name + ": " + warning);
      if (entry.config->residency.preload) submit(entry, Job(Job::Kind::Load));
      return;
    }
  }

  // Invalid. A model that serves keeps serving the version it has.
  if (current && (current->busy || current->runtime)) {
    current->text = v.text;
    current->config_error = v.error;
    log::warn(current->name + " keeps serving its previous config; the edit is invalid: " + v.error);
    return;
  }
  log::warn("invalid " + escape_invalid_utf8(v.file) + ": " + v.error);
  if (!current) {
    std::string name = escape_invalid_utf8(fs::path(v.file).stem().string());
    if (find(name)) name = escape_invalid_utf8(v.file);  // the stem is another model's name
    current = &add_entry(name);
  }
  current->file = v.file;
  current->text = v.text;
  current->serving_text.clear();
  current->config.reset();
  current->dry.reset();
  current->state = ModelState::Invalid;
  current->reason = v.error;
}

void Registry::answer(Job& job, int status, const json& body) {
  if (!job.exchange) return;
  if (job.stream && job.exchange->streaming()) {
    json line = body;
    if (status >= 400) line["status"] = "failed";
    else if (!line.contains("status")) line["status"] = "ready";
    job.exchange->write(json_line(line));
    job.exchange->end();
  } else {
    respond_json(*job.exchange, status, body);
  }
}

void Registry::submit(Entry& entry, Job job) {
  auto refuse = [&](int status, const std::string& message) { answer(job, status, {{"error", message}}); };
  if (shutting_down_ && job.exchange) return refuse(503, "vramd is shutting down");
  if (entry.state == ModelState::Invalid)
    return refuse(409, "model " + quote(entry.name) + " is invalid: " + entry.reason);
  if (entry.removed && job.exchange) return refuse(404, "model " + quote(entry.name) + " was removed");
  if (job.stream && job.exchange) job.exchange->begin_stream(200, "application/x-ndjson");

  // A load while one runs: follow that one.
  if (job.kind == Job::Kind::Load && entry.state == ModelState::Loading && job.exchange) {
    follow_load(entry, job.exchange);
    return send_progress(entry, true);
  }
  if (job.exchange && entry.queue.size() >= config_.limits.queue_length)
    return refuse(429, "model " + quote(entry.name) + " has " + std::to_string(entry.queue.size()) +
                           " requests waiting (queue_length " + std::to_string(config_.limits.queue_length) + ")");
  if (job.stream && (entry.busy || !entry.queue.empty()))
    job.exchange->write(json_line({{"status", "queued"}, {"position", entry.queue.size() + 1}}));
  if (job.kind == Job::Kind::Unload || job.kind == Job::Kind::Offload) {
    // Daemon-initiated evictions go first; a user's unload waits for what is queued before it.
    if (!job.exchange) entry.queue.push_front(std::move(job));
    else entry.queue.push_back(std::move(job));
  } else {
    entry.queue.push_back(std::move(job));
  }
  pump(entry);
}

void Registry::hand_over(Entry& entry, Job& job, const weights::Manifest& manifest) {
  if (!job.hold) return job.exchange->respond(200, "application/json", manifest_line(manifest, entry.name, std::nullopt));
  const uint64_t id = ++leases_made_;
  const auto& request = job.exchange->request();
  entry.leases[id] = {.id = id, .pid = request.peer_pid, .uid = request.peer_uid, .device = job.device,
                      .since = std::chrono::system_clock::now(), .reserved = job.reserve, .peak = std::nullopt, .said = {},
                      .follow = job.follow, .in_place = job.in_place, .channel = nullptr, .sent = manifest.version,
                      .taken = manifest.version};
  std::vector<int> fds;
  for (const auto& region : manifest.regions) fds.push_back(region.fd.get());
  const std::string bytes = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: vramd-lease/1\r\nConnection: Upgrade\r\n\r\n" +
                            manifest_line(manifest, entry.name, id);
  const std::weak_ptr<int> alive = alive_;
  auto channel = job.exchange->upgrade(
      bytes, fds, [this, alive, name = entry.name, id] { if (alive.lock()) end_lease(name, id); },
      [this, alive, name = entry.name, id](std::string_view data) { return alive.lock() && hear(name, id, data); });
  if (!channel) {
    entry.leases.erase(id);
    if (!job.exchange->gone()) respond_error(*job.exchange, 500, "could not hand the lease of " + quote(entry.name) + " over");
    return;
  }
  entry.leases[id].channel = std::move(channel);
  log::info("lease " + std::to_string(id) + " of " + entry.name + " to " + request.peer + ": " +
            counted(manifest.tensors.size(), "tensor") + ", " + format_bytes(manifest.bytes) + " in " +
            counted(manifest.regions.size(), "region"));
}

void Registry::refresh_followers(Entry& entry) {
  for (auto& [id, lease] : entry.leases) refresh(entry, lease);
}

void Registry::refresh(Entry& entry, Lease& lease) {
  if (!lease.follow || lease.taken < lease.sent || entry.version <= lease.sent) return;
  if (lease.in_place) {
    // The update wrote where the lease reads, and its writes were done on the device before it
    // answered: the version's number is all there is to send.
    const json line = {{"model", entry.name}, {"lease", lease.id}, {"version", entry.version}, {"in_place", true}};
    send_version(lease, entry.version, json_line(line), {}, "lease " + std::to_string(lease.id) + " of " + entry.name);
    return;
  }
  Job job(Job::Kind::Lease);
  job.device = lease.device;
  job.refresh = lease.id;
  submit(entry, std::move(job));
}

void Registry::send_refresh(Entry& entry, const Job& job, const Outcome& outcome) {
  const auto found = entry.leases.find(*job.refresh);
  if (found == entry.leases.end()) return;  // it ended meanwhile
  Lease& lease = found->second;
  const std::string what = "lease " + std::to_string(lease.id) + " of " + entry.name;
  if (outcome.status != 200 || !outcome.manifest) {
    log::warn(what + ": the new version's manifest could not be made (" + outcome.error + "); it no longer follows");
    lease.follow = false;
    return;
  }
  if (lease.taken < lease.sent || outcome.manifest->version <= lease.sent) {
    // Versions it does not take would pile up in its socket, each holding its memory: it gets
    // the newest once it has taken the one sent before.
    log::debug(what + ": version " + std::to_string(outcome.manifest->version) + " waits until its client takes version " +
               std::to_string(lease.sent));
    return;
  }
  std::vector<int> fds;
  for (const auto& region : outcome.manifest->regions) fds.push_back(region.fd.get());
  send_version(lease, outcome.manifest->version, manifest_line(*outcome.manifest, entry.name, lease.id), fds,
               what);
}

bool Registry::hear(const std::string& name, uint64_t id, std::string_view data) {
  Entry* entry = find(name);
  if (!entry || !entry->leases.count(id)) return false;
  Lease& lease = entry->leases.at(id);
  bool took = false;
  if (!server::hear(lease, data, "lease " + std::to_string(id) + " of " + name, took)) return false;
  if (took) refresh(*entry, lease);  // it took the version sent before: a newer one made meanwhile goes now
  return true;
}

void Registry::end_lease(const std::string& name, uint64_t id) {
  Entry* entry = find(name);
  if (!entry || !entry->leases.erase(id)) return;
  log::info("lease " + std::to_string(id) + " of " + name + " ended");
  touch(*entry);
  pump(*entry);
}

std::map<std::string, Holdings> Registry::charges() const {
  std::map<std::string, Holdings> out;
  for (const auto& [name, e] : entries_) out.emplace(name, charged(*e));
  return out;
}

std::map<std::string, DeviceUse> Registry::devices(const std::map<std::string, Holdings>& charged_by_model) const {
  std::map<std::string, DeviceUse> devices;
  for (const auto& [device, budget] : config_.budgets) devices[device].budget = budget;
  for (const auto& [device, bytes] : releasing_) devices[device].releasing = bytes;
  for (const auto& [name, charge] : charged_by_model)
    for (const auto& [device, bytes] : weights::totals(charge)) {
      DeviceUse& d = devices[device];  // a device a model names is shown, if only with 0
      if (bytes) d.models[name] = bytes;
    }
  const DeviceBytes use = used(charged_by_model);
  for (auto& [device, d] : devices) {
    d.used = on(use, device);
    if (device == "cpu") d.shared = shared_views(entries());  // in each viewer's charge, taken off `used` once less
  }
  return devices;
}

void Registry::begin_shutdown() {
  shutting_down_ = true;
  if (watcher_) uv_fs_event_stop(watcher_);
  if (debounce_) uv_timer_stop(debounce_);
  for (auto& [name, e] : entries_) {
    uv_timer_stop(e->keep_alive_timer);
    for (auto& job : std::exchange(e->queue, {})) answer(job, 503, {{"error", "vramd is shutting down"}});
    e->waiting_for_room = false;
    if (e->cancel) e->cancel->store(true);
  }
}

size_t Registry::stop_forwards() {
  size_t stopped = 0;
  for (auto& [name, e] : entries_)
    if (e->stop_forward && !e->stop_forward->exchange(true)) stopped++;
  return stopped;
}

bool Registry::idle() const {
  return std::none_of(entries_.begin(), entries_.end(), [](auto& e) { return e.second->busy; });
}

void Registry::close() {
  for (auto& [name, e] : entries_) {
    e->runtime.reset();
    e->worker.reset();
    uv_close(reinterpret_cast<uv_handle_t*>(e->keep_alive_timer), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
  }
  entries_.clear();
  listed_.clear();
  const auto close_and_delete = [](auto*& handle) {
    if (!handle) return;
    uv_close(reinterpret_cast<uv_handle_t*>(handle), [](uv_handle_t* h) { delete reinterpret_cast<std::remove_reference_t<decltype(*handle)>*>(h); });
    handle = nullptr;
  };
  close_and_delete(watcher_);
  close_and_delete(debounce_);
  mailbox_.close();
  std::error_code ec;
  if (!derived_folder_.empty()) fs::remove_all(derived_folder_, ec);
}

}  // namespace vramd::server
