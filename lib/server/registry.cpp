#include "server/registry.hpp"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "server/boundary.hpp"
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
    if (!entry->removed) known[entry->file] = entry->text;
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

std::vector<const Entry*> Registry::entries() const {
  std::vector<const Entry*> out;
  for (const auto& [name, entry] : entries_) out.push_back(entry.get());
  return out;
}

Entry& Registry::add_entry(const std::string& name) {
  auto entry = std::make_unique<Entry>();
  entry->registry = this;
  entry->name = name;
  entry->keep_alive_timer = new uv_timer_t;
  uv_timer_init(loop_, entry->keep_alive_timer);
  entry->keep_alive_timer->data = entry.get();
  return *(entries_[name] = std::move(entry));
}

void Registry::drop_entry(Entry& entry) {
  for (auto& job : entry.queue) answer(job, 404, {{"error", "model " + quote(entry.name) + " was removed (" + entry.file + " is gone)"}});
  uv_close(reinterpret_cast<uv_handle_t*>(entry.keep_alive_timer), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
  log::info("removed " + entry.name);
  entries_.erase(entry.name);
  if (std::exchange(rescan_after_drop_, false)) scan(false);
}

void Registry::apply(ConfigFile v) {
  if (shutting_down_) return;
  Entry* current = nullptr;
  for (auto& [name, entry] : entries_)
    if (entry->file == v.file && !entry->removed) current = entry.get();

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
      v.error = v.file + ": name " + quote(name) + " is already used by " + same->file;
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

namespace {

// What `e`'s weights can hold in the state they are in (weights/holdings.hpp): awake, what its
// plan can fill; asleep, what they hold where they sleep, which cannot grow; while an unload or a
// new config's load frees them on the worker, what they held ("freeing"); none once unloaded.
Holdings holdings(const Entry& e) {
  Holdings held;
  if (!e.runtime || e.state == ModelState::Offloaded) {
    for (const auto& [device, bytes] : e.bytes) held[device][e.runtime ? "offload" : "freeing"] = bytes;
    return held;
  }
  return e.config && e.dry ? weights::awake_holdings(*e.config, *e.dry, e.vram) : held;
}

// What `e`'s leases' clients use on their devices.
DeviceBytes lease_room(const Entry& e) {
  DeviceBytes reserved;
  for (const auto& [id, lease] : e.leases)
    for (const auto& [device, bytes] : lease.reserved) reserved[device] += bytes;
  return reserved;
}

// What `e` counts now, without what it holds back (its job's room, its clients' use).
DeviceBytes held_charges(const Entry& e) { return weights::totals(charge(holdings(e), e.bytes, {}, {})); }

// A lease that takes updates in place and one that keeps its values cannot share a model's GPU
// memory: what the lease `job` asks for would clash with, said, or nothing.
std::optional<std::string> in_place_clash(const Entry& entry, const Job& job) {
  if (!job.hold || job.refresh) return std::nullopt;
  for (const auto& [id, lease] : entry.leases) {
    if (lease.in_place == job.in_place) continue;
    const std::string held = "lease " + std::to_string(id) + " (pid " + std::to_string(lease.pid) + ")";
    if (job.in_place)
      return "model " + quote(entry.name) + " is leased by " + held + ", which keeps its values across updates; with " +
             "in_place updates are written into the memory a lease shares: lease without in_place, or once it ends";
    return "model " + quote(entry.name) + " is leased in place by " + held + ": updates are written into the memory " +
           "it shares, which a lease that keeps its values cannot share: lease with in_place, or once it ends";
  }
  return std::nullopt;
}

}  // namespace

Holdings charged(const Entry& e) {
  Holdings out = charge(holdings(e), e.bytes, e.reserved, lease_room(e));
  uint64_t kept = 0;  // the memfds connections keep for the model's updates, mapped by the daemon
  for (const auto& weak : e.kept)
    if (const auto memfd = weak.lock()) kept += memfd->held().bytes;
  if (kept) out["cpu"]["kept_memfds"] = kept;
  return out;
}

DeviceBytes Registry::used() const {
  DeviceBytes total = releasing_;
  for (const auto& [name, entry] : entries_)
    for (const auto& [device, bytes] : weights::totals(charged(*entry))) total[device] += bytes;
  return total;
}

bool Registry::fits(const DeviceBytes& more, const DeviceBytes& used) const {
  for (const auto& [device, bytes] : more) {
    const auto budget = config_.budgets.find(device);
    if (budget != config_.budgets.end() && on(used, device) + bytes > budget->second) return false;
  }
  return true;
}

Holder Registry::holder_on(const Entry& e, const std::string& device, const DeviceBytes& used) const {
  const bool ready = e.state == ModelState::Ready;
  return {.name = e.name,
          .bytes = on(held_charges(e), device),
          .reserved = on(e.reserved, device) + on(lease_room(e), device),
          .last_used = e.last_used,
          .loaded = e.runtime && e.config,
          .ready = ready,
          .offload_device = e.config ? e.config->vram.offload.device.str() : "",
          // Sleeping it must fit where it sleeps (on another device than the one asked for).
          .offload_fits = ready && e.config && e.dry && fits(weights::totals(weights::asleep_holdings(*e.config, *e.dry)), used),
          .pinned = e.config && e.config->residency.pinned,
          .leased = !e.leases.empty(),
          .busy = e.busy || !e.queue.empty(),
          .waiting_for_room = e.waiting_for_room};
}

bool Registry::make_room(Entry& entry, const std::string& device, uint64_t need) {
  const auto budget = config_.budgets.find(device);
  if (budget == config_.budgets.end()) return true;  // no budget: the device's own size is the limit
  const DeviceBytes use = used();
  // Values being freed still hold their pages (counted in `use`): wait for them rather than evict for them.
  if (on(releasing_, device) && on(use, device) + need > budget->second) return false;
  std::vector<Holder> holders;
  for (const auto& [name, e] : entries_) holders.push_back(holder_on(*e, device, use));
  const RoomPlan plan = plan_room({entry.name, device, need, budget->second}, holders);
  if (!plan.error.empty()) throw Error(plan.error);
  for (const auto& eviction : plan.evictions) {
    Job job(eviction.kind == Eviction::Kind::Offload ? Job::Kind::Offload : Job::Kind::Unload);
    log::info("making room for " + entry.name + " on " + device + ": " + job.name() + " " + eviction.model + " (" +
              format_bytes(eviction.bytes) + ")");
    submit(*find(eviction.model), std::move(job));
  }
  return plan.evictions.empty();
}

bool Registry::reserve(Entry& entry, const DeviceBytes& expected, const DeviceBytes& extra) {
  DeviceBytes need = extra;
  const DeviceBytes have = held_charges(entry);
  for (const auto& [device, bytes] : expected)
    if (const uint64_t more = bytes - std::min(bytes, on(have, device))) need[device] += more;
  for (const auto& [device, bytes] : need)
    if (!make_room(entry, device, bytes)) return false;
  entry.reserved = need;
  return true;
}

void Registry::pump(Entry& entry) {
  while (!entry.busy && !entry.queue.empty()) {
    Job& job = entry.queue.front();
    if (job.exchange && job.exchange->gone()) {
      entry.queue.pop_front();
      continue;
    }
    const bool resident = entry.runtime && entry.state == ModelState::Ready;
    const auto done_now = [&](int status, const json& body) {
      Job finished = std::move(job);
      entry.queue.pop_front();
      answer(finished, status, body);
    };
    // Answered with the model as it is once the job has left the queue (not counted as queued).
    const auto done_as_it_is = [&] {
      Job finished = std::move(job);
      entry.queue.pop_front();
      answer(finished, 200, entry_json(entry));
    };
    // Nothing takes a leased model's weights from under its clients: wait for the leases to end
    // (end_lease pumps again), or refuse at once when asked not to wait.
    if (job.takes_weights() && !entry.leases.empty()) {
      if (job.exchange && !job.wait) {
        done_now(409, {{"error", "model " + quote(entry.name) + " is leased by " + holders(entry) + "; " + job.name() +
                                     " it once they end, or leave out wait=false to wait for them"}});
        continue;
      }
      return;
    }
    switch (job.kind) {
      case Job::Kind::Load:
        if (resident) { done_as_it_is(); continue; }
        break;
      case Job::Kind::Onload:
        if (!entry.runtime) { done_now(409, {{"error", "model " + quote(entry.name) + " is not loaded; load it"}}); continue; }
        if (resident) { done_as_it_is(); continue; }
        break;
      case Job::Kind::Offload:
        if (!entry.runtime) { done_now(409, {{"error", "model " + quote(entry.name) + " is not loaded"}}); continue; }
        if (entry.state == ModelState::Offloaded) { done_as_it_is(); continue; }
        break;
      case Job::Kind::Unload:
        if (!entry.runtime) {
          entry.state = entry.state == ModelState::Failed ? ModelState::Failed : ModelState::Unloaded;
          done_as_it_is();
          if (entry.removed) return drop_entry(entry);
          continue;
        }
        break;
      case Job::Kind::Update:
        if (!entry.runtime) {
          done_now(409, {{"error", "model " + quote(entry.name) + " is not loaded; an update changes a loaded model's " +
                                       "weights: load it first (a load reads its config's checkpoint)"}});
          continue;
        }
        break;
      case Job::Kind::Lease:
        if (const auto clash = in_place_clash(entry, job)) { done_now(409, {{"error", *clash}}); continue; }
        break;
      case Job::Kind::Replace:
        if (!entry.replacement) { done_as_it_is(); continue; }  // the edit was taken back
        break;
      case Job::Kind::Forward:
        break;
    }
    if (!entry.config) { done_now(409, {{"error", "model " + quote(entry.name) + " has no valid config"}}); continue; }

    // Room for what the job will hold: the weights in their computation state, or asleep on
    // the offload device. The budget counts it from now on (as reserved, then as held).
    // A lease may also hold room for what its managed client uses on its own device.
    std::optional<DeviceBytes> expected;
    if (job.needs_weights() && !resident) expected = weights::totals(weights::awake_holdings(*entry.config, *entry.dry, entry.runtime ? entry.vram : std::nullopt));
    else if (job.kind == Job::Kind::Offload && entry.state == ModelState::Ready)
      expected = weights::totals(weights::asleep_holdings(*entry.config, *entry.dry));
    if (expected || !job.reserve.empty()) {
      try {
        if (!reserve(entry, expected.value_or(DeviceBytes{}), job.reserve)) {
          entry.waiting_for_room = true;
          return;
        }
      } catch (const Error& e) {
        entry.waiting_for_room = false;
        // A load refused for room leaves the model unloaded: its status says why.
        if (!entry.runtime && job.loads()) entry.reason = std::string("not loaded: ") + e.what();
        done_now(507, {{"error", e.what()}});
        continue;
      }
    }
    entry.waiting_for_room = false;
    Job next = std::move(job);
    entry.queue.pop_front();
    start_job(entry, std::move(next));
  }
}

void Registry::start_job(Entry& entry, Job job) {
  entry.busy = true;
  if (!entry.worker) entry.worker = std::make_unique<Worker>("vramd:" + entry.name);
  if (!entry.runtime && job.loads()) {
    entry.state = ModelState::Loading;
    entry.progress = {};
    entry.cancel = std::make_shared<std::atomic<bool>>(false);
    entry.load_watchers.clear();
    if (job.exchange && job.kind == Job::Kind::Load) follow_load(entry, job.exchange);
    log::info("loading " + entry.name);
  }
  if (job.kind == Job::Kind::Forward) {
    entry.stop_forward = job.stop = std::make_shared<std::atomic<bool>>(false);
    // A forward nobody waits for stops, and with it the load it started, if nobody else needs that.
    if (job.exchange)
      job.exchange->on_gone([e = &entry, stop = job.stop] {
        stop->store(true);
        cancel_unwatched_load(*e);
      });
  }
  if (job.kind == Job::Kind::Update)  // no lease keeps its values in the model's GPU memory: written there
    job.in_place = std::all_of(entry.leases.begin(), entry.leases.end(), [](const auto& l) { return l.second.in_place; });
  std::shared_ptr<Runtime> runtime = entry.runtime;
  if (job.kind == Job::Kind::Unload || job.kind == Job::Kind::Replace) entry.runtime.reset();  // freed on the worker
  auto shared_job = std::make_shared<Job>(std::move(job));
  Entry* e = &entry;
  entry.worker->run([this, e, runtime, shared_job, config = *entry.config, cancel = entry.cancel]() mutable {
    auto last = Clock::now();
    const auto progress = [&](const LoadProgress& p) {
      if (p.tensors_done == p.tensors_total || Clock::now() - last > std::chrono::milliseconds(100)) {
        last = Clock::now();
        mailbox_.post([this, e, p] {
          e->progress = p;
          send_progress(*e, false);
        });
      }
      return !cancel->load();
    };
    auto outcome = std::make_shared<Outcome>(run_job(*shared_job, std::move(runtime), config, progress));
    mailbox_.post([this, e, shared_job, outcome] {
      release(std::move(outcome->replaced), outcome->replaced_bytes);
      finish_job(*e, std::move(*shared_job), *outcome);
    });
  });
}

void Registry::release(std::shared_ptr<void> values, const DeviceBytes& bytes) {
  if (!values) return;
  for (const auto& [device, n] : bytes) releasing_[device] += n;
  releaser_.run([this, values = std::move(values), bytes]() mutable {
    values.reset();  // here, before the loop hears of it
    mailbox_.post([this, bytes] {
      for (const auto& [device, n] : bytes)
        if ((releasing_[device] -= n) == 0) releasing_.erase(device);
      pump_waiting_for_room();
    });
  });
}

void Registry::finish_job(Entry& entry, Job job, const Outcome& outcome) {
  entry.busy = false;
  entry.reserved.clear();
  entry.runtime = outcome.runtime;
  entry.version = outcome.version;
  entry.bytes = outcome.bytes;
  entry.vram = outcome.vram;
  auto watchers = std::exchange(entry.load_watchers, {});
  entry.cancel.reset();
  entry.stop_forward.reset();
  const std::string what = std::string(job.name()) + " " + entry.name;

  // An update whose new values (or the memfd it would keep) need room beside the old ones, more
  // than was reserved (nothing changed yet): it runs again, first in the queue, once that room is
  // reserved (or is refused with 507 in pump). Each run asks for more, so this ends.
  const auto covered = [&](const DeviceBytes& need) {
    return std::all_of(need.begin(), need.end(), [&](const auto& n) { return n.second <= on(job.reserve, n.first); });
  };
  if (!outcome.needs_room.empty() && !covered(outcome.needs_room)) {
    job.reserve = outcome.needs_room;
    entry.queue.push_front(std::move(job));
    pump(entry);
    return;
  }
  if (outcome.loaded) {
    entry.loads++;
    entry.load_seconds = outcome.load_seconds;
    entry.state = ModelState::Ready;
    entry.reason.clear();
    log::info("ready " + entry.name + " in " + format_seconds(outcome.load_seconds) + ", " +
              format_bytes(entry.dry->report.bytes));
  }
  json body;
  int status = outcome.status;
  if (!outcome.load_error.empty()) {
    entry.state = outcome.cancelled ? ModelState::Unloaded : ModelState::Failed;
    entry.reason = outcome.load_error;
    status = outcome.cancelled ? 499 : 500;
    body = {{"error", (outcome.cancelled ? "" : "loading " + quote(entry.name) + " failed: ") + outcome.load_error}};
    log::warn(body["error"].get<std::string>());
  } else if (outcome.cancelled) {  // a forward whose client went away, or cut short by a shutdown
    entry.state = ModelState::Ready;
    entry.forwards_cancelled++;
    const bool gone = !job.exchange || job.exchange->gone();
    const std::string why = gone ? "the client went away" : "vramd is shutting down and its grace period is over";
    log::info(what + " stopped after " + format_seconds(outcome.seconds) + ": " + why + "; " + outcome.error);
    status = 503;
    body = {{"error", "forward of " + quote(entry.name) + " stopped: " + why + " (" + outcome.error + ")"}};
  } else if (status != 200) {
    body = {{"error", outcome.error}};
    if (job.kind == Job::Kind::Forward) entry.forward_errors++;
    if (outcome.weights_lost) {
      // It is unloaded (freed on the worker, off the event loop), and the next request loads it
      // again: from the checkpoint once it is whole, with a rank that died started again where
      // the daemon started it (dist::LocalRankSupervisor).
      entry.worker->run([doomed = std::move(entry.runtime)] {});
      entry.bytes.clear();
      entry.vram.reset();
      entry.state = ModelState::Unloaded;
      entry.reason = outcome.error;
    }
    log::warn(what + ": " + outcome.error + (outcome.weights_lost ? "; unloaded" : ""));
  } else {
    switch (job.kind) {
      case Job::Kind::Offload: entry.state = ModelState::Offloaded; break;
      case Job::Kind::Onload: entry.state = ModelState::Ready; break;
      case Job::Kind::Unload: entry.state = ModelState::Unloaded; break;
      case Job::Kind::Forward:
        entry.state = ModelState::Ready;
        entry.forwards++;
        entry.forward_seconds += outcome.seconds;
        break;
      case Job::Kind::Replace: {
        // The newest version queued (pump answers a replacement whose edit was taken back
        // without running it, but one may be taken back while it runs: then the config that
        // served is loaded again).
        const bool was_loaded = entry.state == ModelState::Ready || entry.state == ModelState::Offloaded;
        const bool replaced = entry.replacement.has_value();
        if (replaced) {
          auto [config, dry] = std::move(*entry.replacement);
          entry.replacement.reset();
          entry.config = std::move(config);
          entry.dry = std::move(dry);
        }
        entry.serving_text = entry.text;
        entry.keep_alive = entry.config->residency.keep_alive;
        entry.state = ModelState::Unloaded;
        log::info(replaced ? "new config for " + entry.name + " in effect"
                           : entry.name + ": its edit was taken back; the config that served is loaded again");
        if (was_loaded || entry.config->residency.preload) submit(entry, Job(Job::Kind::Load));
        break;
      }
      case Job::Kind::Load:
      case Job::Kind::Lease: entry.state = ModelState::Ready; break;
      case Job::Kind::Update:
        entry.state = ModelState::Ready;
        entry.updates++;
        entry.update_seconds += outcome.updated.seconds;
        log::info(what + ": " + counted(outcome.updated.tensors, "tensor") + ", " + format_bytes(outcome.updated.bytes) +
                  " in " + format_seconds(outcome.updated.seconds) + "; version " + std::to_string(outcome.version));
        break;
    }
    if (job.kind == Job::Kind::Offload || job.kind == Job::Kind::Onload)
      log::info(what + ": " + format_bytes(outcome.moved.bytes) + " in " + format_seconds(outcome.moved.seconds));
    body = entry_json(entry);
    if (job.kind == Job::Kind::Offload || job.kind == Job::Kind::Onload)
      body["moved"] = {{"bytes", outcome.moved.bytes}, {"seconds", outcome.moved.seconds}};
    if (job.kind == Job::Kind::Update) {
      body["updated"] = {{"tensors", outcome.updated.tensors}, {"bytes", outcome.updated.bytes},
                         {"seconds", outcome.updated.seconds}};
      if (!outcome.updated.kept.empty())
        body["updated"]["kept"] = {{"memfd", outcome.updated.kept}, {"page_locked", outcome.updated.page_locked}};
    }
  }

  if (job.refresh) send_refresh(entry, job, outcome);
  if (job.kind == Job::Kind::Update && status == 200) refresh_followers(entry);
  // Answer the job (unless it is a load, answered below with everyone following it).
  if (job.exchange && std::find(watchers.begin(), watchers.end(), job.exchange) == watchers.end()) {
    if (job.kind == Job::Kind::Forward && status == 200) job.exchange->respond(200, "application/octet-stream", outcome.output);
    else if (job.kind == Job::Kind::Lease && status == 200) hand_over(entry, job, *outcome.manifest);
    else answer(job, status, body);
  }
  // Followers hear how the load went, whatever became of the forward that started it.
  const bool loaded = outcome.load_error.empty() && (job.kind != Job::Kind::Load || status == 200);
  json load_body = loaded ? entry_json(entry) : body;
  if (loaded) load_body["status"] = "ready";
  for (auto& watcher : watchers) {
    Job follower(Job::Kind::Load, watcher, watcher->streaming());
    answer(follower, loaded ? 200 : status, load_body);
  }

  if (entry.removed && !entry.runtime && !entry.busy) {
    drop_entry(entry);  // answers what was queued for it
  } else {
    touch(entry);
    pump(entry);
  }
  pump_waiting_for_room();
}

void Registry::pump_waiting_for_room() {
  for (auto& [name, other] : entries_)
    if (other->waiting_for_room && !other->busy) pump(*other);
}

void Registry::follow_load(Entry& entry, const std::shared_ptr<Exchange>& exchange) {
  entry.load_watchers.push_back(exchange);
  exchange->on_gone([e = &entry] { cancel_unwatched_load(*e); });
}

void Registry::cancel_unwatched_load(Entry& entry) {
  // Closing the connection cancels the load once nobody else follows or waits for it.
  if (entry.cancel && entry.queue.empty() &&
      std::all_of(entry.load_watchers.begin(), entry.load_watchers.end(), [](auto& w) { return w->gone(); }))
    entry.cancel->store(true);
}

void Registry::send_progress(Entry& entry, bool force) {
  const auto now = Clock::now();
  if (!force && now - entry.progress_sent < std::chrono::milliseconds(100) &&
      entry.progress.tensors_done != entry.progress.tensors_total)
    return;
  entry.progress_sent = now;
  json line = progress_json(entry.progress);
  line["status"] = "loading";
  const std::string text = json_line(line);
  for (auto& watcher : entry.load_watchers)
    if (watcher->unsent() < (64 << 10)) watcher->write(text);  // a slow reader skips updates
}

void Registry::touch(Entry& entry) {
  entry.last_used = Clock::now();
  uv_timer_stop(entry.keep_alive_timer);
  if (!entry.runtime || !entry.keep_alive || (entry.config && entry.config->residency.pinned) || shutting_down_) return;
  uv_timer_start(
      entry.keep_alive_timer,
      [](uv_timer_t* timer) {
        auto* e = static_cast<Entry*>(timer->data);
        guarded("the keep_alive of " + e->name, [&] {
          if (e->busy || !e->queue.empty() || !e->runtime || !e->leases.empty()) return;  // a lease's end touches it again
          log::info("keep_alive of " + e->name + " ran out: unloading");
          e->registry->submit(*e, Job(Job::Kind::Unload));
        });
      },
      static_cast<uint64_t>(entry.keep_alive->count()), 0);
}

void Registry::hand_over(Entry& entry, Job& job, const weights::Manifest& manifest) {
  if (!job.hold) return respond_json(*job.exchange, 200, manifest_json(manifest, entry.name, std::nullopt));
  const uint64_t id = ++leases_made_;
  const auto& request = job.exchange->request();
  entry.leases[id] = {.id = id, .pid = request.peer_pid, .uid = request.peer_uid, .device = job.device,
                      .since = std::chrono::system_clock::now(), .reserved = job.reserve, .peak = std::nullopt, .said = {},
                      .follow = job.follow, .in_place = job.in_place, .channel = nullptr, .sent = manifest.version,
                      .taken = manifest.version};
  std::vector<int> fds;
  for (const auto& region : manifest.regions) fds.push_back(region.fd.get());
  const std::string bytes = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: vramd-lease/1\r\nConnection: Upgrade\r\n\r\n" +
                            json_line(manifest_json(manifest, entry.name, id));
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
    return send_version(entry, lease, entry.version, json_line(line), {});
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
  send_version(entry, lease, outcome.manifest->version, json_line(manifest_json(*outcome.manifest, entry.name, lease.id)),
               fds);
}

void Registry::send_version(const Entry& entry, Lease& lease, uint64_t version, const std::string& line,
                            const std::vector<int>& fds) {
  const std::string what = "lease " + std::to_string(lease.id) + " of " + entry.name;
  if (!lease.channel || !lease.channel->send(line, fds)) {
    log::warn(what + ": its client has not taken what was sent before, or is gone; it no longer follows");
    lease.follow = false;
    return;
  }
  lease.sent = version;
  log::info(what + ": version " + std::to_string(version) + " sent" + (lease.in_place ? " (written in place)" : ""));
}

bool Registry::hear(const std::string& name, uint64_t id, std::string_view data) {
  Entry* entry = find(name);
  if (!entry || !entry->leases.count(id)) return false;
  Lease& lease = entry->leases.at(id);
  lease.said.append(data);
  for (size_t end; (end = lease.said.find('\n')) != std::string::npos;) {
    const json line = json::parse(std::string_view(lease.said).substr(0, end), nullptr, false);
    lease.said.erase(0, end + 1);
    const auto said = [&](const char* key) { return line.size() == 1 && line.contains(key) && line[key].is_number_unsigned(); };
    if (!line.is_object() || !(said("peak") || said("taken"))) {
      log::warn("lease " + std::to_string(id) + " of " + name + ": its client sent a line that is neither {\"peak\": N} "
                "nor {\"taken\": VERSION}; the lease ends");
      return false;
    }
    if (said("peak")) {
      lease.peak = line["peak"].get<uint64_t>();
      continue;
    }
    lease.taken = std::max(lease.taken, std::min(line["taken"].get<uint64_t>(), lease.sent));
    refresh(*entry, lease);  // it took the version sent before: a newer one made meanwhile goes now
  }
  if (lease.said.size() <= 4096) return true;
  log::warn("lease " + std::to_string(id) + " of " + name + ": its client sent a line past 4 KiB; the lease ends");
  return false;
}

void Registry::end_lease(const std::string& name, uint64_t id) {
  Entry* entry = find(name);
  if (!entry || !entry->leases.erase(id)) return;
  log::info("lease " + std::to_string(id) + " of " + name + " ended");
  touch(*entry);
  pump(*entry);
}

json Registry::devices_json() const {
  json devices = json::object();
  std::set<std::string> names;
  for (const auto& [device, budget] : config_.budgets) names.insert(device);
  for (const auto& [device, bytes] : releasing_) names.insert(device);
  std::map<std::string, DeviceBytes> charges;  // by model
  DeviceBytes use = releasing_;
  for (const auto& [name, e] : entries_) {
    charges[name] = weights::totals(charged(*e));
    for (const auto& [device, bytes] : charges[name]) {
      names.insert(device);
      use[device] += bytes;
    }
  }
  for (const auto& device : names) {
    json models = json::object();  // what each model counts, which with `releasing` adds up to `used`
    for (const auto& [name, bytes] : charges)
      if (const uint64_t b = on(bytes, device)) models[name] = b;
    const auto budget = config_.budgets.find(device);
    devices[device] = {{"budget", budget == config_.budgets.end() ? json(nullptr) : json(budget->second)},
                       {"used", on(use, device)}, {"releasing", on(releasing_, device)}, {"models", models}};
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
  const auto close_and_delete = [](auto*& handle) {
    if (!handle) return;
    uv_close(reinterpret_cast<uv_handle_t*>(handle), [](uv_handle_t* h) { delete reinterpret_cast<std::remove_reference_t<decltype(*handle)>*>(h); });
    handle = nullptr;
  };
  close_and_delete(watcher_);
  close_and_delete(debounce_);
  mailbox_.close();
}

}  // namespace vramd::server
