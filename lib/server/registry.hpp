// The daemon's models: one entry per config file in the watched folder (server/entry.hpp), each
// with its state, its queue of requests and a worker thread that runs them in order (so forwards
// on different models run in parallel and those on one model in order). Residency is decided
// here: device budgets (server/budget.hpp decides what fits), making room by offloading and then
// unloading idle models (server/eviction.hpp plans which), keep-alive, preload. The folder is read
// and validated by server/catalog.hpp, and an entry becomes JSON in server/status.hpp. Its code
// is in two files by concern: registry.cpp (entries, configs, the folder, leases, shutdown) and
// registry_queue.cpp (the job queue: room, running jobs, their outcomes, progress, keep-alive).
//
// Everything here runs on the loop thread except the jobs on the workers, which touch only
// their own model's Runtime and report back through the Mailbox.
#pragma once

#include <uv.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "model/load_report.hpp"
#include "server/catalog.hpp"
#include "server/charges.hpp"
#include "server/entry.hpp"
#include "server/eviction.hpp"
#include "server/http.hpp"
#include "server/job.hpp"
#include "server/mailbox.hpp"
#include "server/runtime.hpp"

namespace vramd::server {

// A device as GET /v1/status shows it: `used` is what the models count there (with
// `releasing`, less the checkpoint pages several view, `shared`, on cpu).
struct DeviceUse {
  std::optional<uint64_t> budget;  // none: limited by its size
  uint64_t used = 0, releasing = 0, shared = 0;
  std::map<std::string, uint64_t> models;  // each model's charge there, by name
};

class Registry {
 public:
  Registry(uv_loop_t* loop, const config::DaemonConfig& config);
  ~Registry();

  // Validates every config in the folder now (at start), then loads the preload ones.
  void start();
  // Re-reads the folder; `force` re-validates unchanged files too. `done` runs once every
  // validation this started has been applied.
  void scan(bool force, std::function<void()> done = {});

  Entry* find(const std::string& name);
  // Every entry, in name order: kept beside them, so that asking allocates nothing (a status
  // request asks three times). Adding or dropping an entry changes it.
  const std::vector<const Entry*>& entries() const { return listed_; }

  // Requests; each answers its exchange.
  void submit(Entry& entry, Job job);
  // POST /v1/models/BASE/derive (server/derive.cpp): a model of `base`'s config with `converter`
  // (a Lua converter's text) as its converter, named BASE.derived-HASH and shared by every client
  // that sends the same text, checked off the loop as a config is. `done` gets 200 and the model's
  // object (with "created": whether this call made it), or a refusal naming what is wrong.
  void derive(Entry& base, std::string converter, std::function<void(int, const nlohmann::json&)> done);
  // DELETE /v1/models/NAME: a derived model goes, once its work and leases end (as when its
  // base's config changes), and `exchange` is answered then; a model of a config file is a 409.
  void remove(Entry& entry, std::shared_ptr<Exchange> exchange);

  // Each entry's charged() (server/budget.hpp), by name.
  std::map<std::string, Holdings> charges() const;
  // Budgets and use per device from those charges (server/status.hpp writes them).
  std::map<std::string, DeviceUse> devices(const std::map<std::string, Holdings>& charges) const;

  // SIGTERM: refuse queued work, cancel loads; `idle()` says when in-flight work has ended.
  void begin_shutdown();
  // Once the grace period is over: forwards still running stop before their next layer (a
  // partitioned one runs to its end) and are answered 503. Returns how many were asked to.
  size_t stop_forwards();
  bool idle() const;
  void close();  // frees every model (joins the workers) and closes the handles

 private:
  // A config file as the validator found it (server/catalog.hpp), against what is served.
  void apply(ConfigFile file);
  Entry& add_entry(const std::string& name);
  void drop_entry(Entry& entry);
  void relist();  // listed_ from entries_, after either changes
  // `base`'s config changes or goes: the models derived from it go too, once their work and
  // leases end (as a model whose file is gone does).
  void retire_derived(const Entry& base);
  // The daemon's own folder for the converters of derived models, made on first use.
  std::string derived_folder();

  void pump(Entry& entry);
  void pump_waiting_for_room();  // after room was given back: a job ended, or values were freed
  void start_job(Entry& entry, Job job);
  void finish_job(Entry& entry, Job job, const Outcome& outcome);
  void answer(Job& job, int status, const nlohmann::json& body);
  // Frees values an update replaced on releaser_, off the loop and the model's queue (a 300 MiB
  // memfd takes tens of milliseconds to give back), counting their bytes in releasing_ until then.
  void release(std::shared_ptr<void> values, const DeviceBytes& bytes);

  // Room on `device` for `bytes` more: true when it fits; false while evictions run or replaced
  // values are freed there, when they are needed for it (the entry is pumped again when they
  // end); throws Error with the numbers when it cannot fit. Evicting another frees what it holds
  // that no other model does once the entry holds the views `after` its job.
  bool make_room(Entry& entry, const std::string& device, uint64_t bytes, model::FileSpans after);
  // Room for what the entry will hold on each device (`expected`), less what it counts there
  // now, and for `extra` (a lease's room for its client), reserved for its next job: true once
  // reserved; else as make_room. `views`: for a job that replaces the entry's weights, the views
  // they will hold (a load's views_to_come, counted as the entry's from now on, and once where
  // others hold them too; none for a sleep or a wake). Views it drops that others hold stay
  // held: they free none of the room the job needs.
  bool reserve(Entry& entry, const DeviceBytes& expected, const DeviceBytes& extra = {},
               std::optional<model::FileSpans> views = std::nullopt);
  // The sum of every entry's charge on each device, and the values being freed (releasing_): one
  // pass over the entries, so that a question asked of each entry (holder_on) is not one pass each.
  DeviceBytes used() const;
  DeviceBytes used(const std::map<std::string, Holdings>& charges) const;  // from charges() made already

  void touch(Entry& entry);
  void hand_over(Entry& entry, Job& job, const weights::Manifest& manifest);
  // After an update: each following lease of the entry gets the new version's manifest (a lease
  // job of the daemon's own each, run in the entry's queue).
  void refresh_followers(Entry& entry);
  // That job for one lease, if it follows, has taken the version sent before and is behind.
  void refresh(Entry& entry, Lease& lease);
  void send_refresh(Entry& entry, const Job& job, const Outcome& outcome);
  void end_lease(const std::string& name, uint64_t id);
  // A lease's client speaks: {"peak": N} lines, the most it has used of its reservation. False
  // (the lease ends, with a warning) for anything else.
  bool hear(const std::string& name, uint64_t id, std::string_view data);
  void follow_load(Entry& entry, const std::shared_ptr<Exchange>& exchange);
  static void cancel_unwatched_load(Entry& entry);
  void send_progress(Entry& entry, bool force);

  uv_loop_t* loop_;
  config::DaemonConfig config_;
  Mailbox mailbox_;
  Worker validator_{"vramd-validate"};
  Worker releaser_{"vramd-release"};
  DeviceBytes releasing_;  // bytes of values on releaser_, not yet freed, by device
  uv_fs_event_t* watcher_ = nullptr;
  uv_timer_t* debounce_ = nullptr;
  std::map<std::string, std::unique_ptr<Entry>> entries_;  // by name
  std::vector<const Entry*> listed_;                       // entries_' values, in its order (relist)
  bool shutting_down_ = false;
  size_t validations_in_flight_ = 0;
  bool rescan_after_drop_ = false;
  std::vector<std::function<void()>> scan_done_;
  uint64_t leases_made_ = 0;
  std::string derived_folder_;  // removed by close()
  uint64_t derivations_ = 0;    // each one's converter is a file of its own there
  std::shared_ptr<int> alive_ = std::make_shared<int>();  // lease connections outliving the registry see it gone
};

}  // namespace vramd::server
