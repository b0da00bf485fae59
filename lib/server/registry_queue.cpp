// The registry's queue of jobs (server/registry.hpp): the room each job needs, reserved before it
// runs (evicting idle models where the budget needs it: server/budget.hpp decides, server/eviction.hpp
// plans), each job run on its model's worker and its outcome applied on the loop, progress
// streamed, keep-alive. The registry's entries, configs and leases are in registry.cpp.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "server/boundary.hpp"
#include "server/budget.hpp"
#include "server/eviction.hpp"
#include "server/leases.hpp"
#include "server/registry.hpp"
#include "server/reply.hpp"
#include "server/status.hpp"
#include "util/format.hpp"
#include "util/log.hpp"
#include "weights/holdings.hpp"

namespace vramd::server {
using nlohmann::json;

DeviceBytes Registry::used() const { return used(charges()); }

DeviceBytes Registry::used(const std::map<std::string, Holdings>& charges) const {
  DeviceBytes total = releasing_;
  for (const auto& [name, charge] : charges)
    for (const auto& [device, bytes] : weights::totals(charge)) total[device] += bytes;
  if (const uint64_t shared = shared_views(entries())) total["cpu"] -= shared;  // counted in each viewer's charge
  return total;
}

bool Registry::make_room(Entry& entry, const std::string& device, uint64_t need, model::FileSpans after) {
  const auto budget = config_.budgets.find(device);
  if (budget == config_.budgets.end()) return true;  // no budget: the device's own size is the limit
  const DeviceBytes use = used();
  // Values being freed still hold their pages (counted in `use`): wait for them rather than evict for them.
  if (on(releasing_, device) && on(use, device) + need > budget->second) return false;
  std::vector<Holder> holders;
  const std::vector<const Entry*>& all = entries();
  const uint64_t shared = device == "cpu" ? shared_views(all) : 0;
  // What evicting another frees, once the entry holds the views `after` its job.
  model::FileSpans now = std::exchange(entry.views, after);
  for (const auto& [name, e] : entries_) {
    // Sleeping it must fit where it sleeps (on another device than the one asked for).
    const bool offload_fits =
        e->config && e->dry && fits(weights::totals(weights::asleep_holdings(*e->config, *e->dry)), use, config_.budgets);
    holders.push_back(holder_on(*e, device, offload_fits, viewed_by_others(e->views, all, e.get())));
  }
  entry.views = std::move(now);
  const RoomPlan plan = plan_room({entry.name, device, need, budget->second, shared}, holders);
  if (!plan.error.empty()) throw Error(plan.error);
  for (const auto& eviction : plan.evictions) {
    Job job(eviction.kind == Eviction::Kind::Offload ? Job::Kind::Offload : Job::Kind::Unload);
    log::info("making room for " + entry.name + " on " + device + ": " + job.name() + " " + eviction.model + " (" +
              format_bytes(eviction.bytes) + ")");
    submit(*find(eviction.model), std::move(job));
  }
  return plan.evictions.empty();
}

bool Registry::reserve(Entry& entry, const DeviceBytes& expected, const DeviceBytes& extra, std::optional<model::FileSpans> views) {
  // Of what it holds, a job that replaces its weights frees all but the views others hold too.
  DeviceBytes have = held_charges(entry);
  if (views) have["cpu"] -= std::min(have["cpu"], viewed_by_others(entry.views, entries(), &entry));
  const DeviceBytes need = room_to_reserve(expected, have, extra);
  // The views a load will hold count from now on, as its reservation does: pages others view
  // already are counted once (used() then counts them in the room reserved and takes them off
  // again). A sleep's or a wake's views count once it is done.
  model::FileSpans before = views && !views->empty() ? std::exchange(entry.views, *views) : entry.views;
  try {
    for (const auto& [device, bytes] : need)
      if (!make_room(entry, device, bytes, views.value_or(entry.views))) {
        entry.views = std::move(before);
        return false;
      }
  } catch (...) {
    entry.views = std::move(before);
    throw;
  }
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
        if (job.in_place && entry.config && config::clients_apply_adapters(*entry.config)) {
          done_now(409, {{"error", "model " + quote(entry.name) + " has its LoRA adapters applied by its clients, and a lease "
                                   "that follows in place is sent version numbers alone, not the adapters in force: "
                                   "lease with follow instead"}});
          continue;
        }
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
    // A lease on the host packs the copies the model shares with others into memory of its own:
    // room for those it holds now, and none of those a load for it would share counted on.
    std::optional<DeviceBytes> expected;
    if (job.needs_weights() && !resident) expected = weights::totals(weights::awake_holdings(*entry.config, *entry.dry, entry.runtime ? entry.vram : std::nullopt));
    else if (job.kind == Job::Kind::Offload && entry.state == ModelState::Ready)
      expected = weights::totals(weights::asleep_holdings(*entry.config, *entry.dry));
    const bool packs = job.kind == Job::Kind::Lease && job.device == "cpu";
    DeviceBytes extra = job.reserve;
    if (packs && entry.runtime)
      if (const uint64_t copies = shared_copies(entry, entries())) extra["cpu"] += copies;
    if (expected || !extra.empty()) {
      try {
        const bool loads = !entry.runtime && job.loads();
        std::optional<model::FileSpans> views;
        if (expected) views = loads ? views_to_come(entry, !packs) : model::FileSpans{};
        if (!reserve(entry, expected.value_or(DeviceBytes{}), extra, std::move(views))) {
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
      release(std::move(outcome->replaced), freed_by_release(outcome->replaced_bytes, *e, outcome->views, entries()));
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
  entry.views = outcome.views;
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
      entry.views = {};
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
        if (outcome.updated.adapters) {  // POST .../loras: the set in force, for the status, charges and reloads
          entry.dry->report.adapters = *outcome.updated.adapters;
          entry.config->lora = *job.loras;
        }
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

}  // namespace vramd::server
