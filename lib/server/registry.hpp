// The daemon's models: one entry per config file in the watched folder, each with its state,
// its queue of requests and a worker thread that runs them in order (so forwards on different
// models run in parallel and those on one model in order). Residency is decided here: device
// budgets, making room by offloading and then unloading idle models (server/eviction.hpp plans
// which), keep-alive, preload. The folder is read and validated by server/catalog.hpp, and an
// entry becomes JSON in server/status.hpp.
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
#include "server/eviction.hpp"
#include "server/http.hpp"
#include "server/job.hpp"
#include "server/mailbox.hpp"
#include "server/runtime.hpp"

namespace vramd::server {

enum class ModelState { Unloaded, Loading, Ready, Offloaded, Failed, Invalid };
const char* state_name(ModelState state);  // server/status.cpp

using Clock = std::chrono::steady_clock;

class Registry;

// A client holding a model's weights (weights/lease.hpp): one per handed-over connection.
struct Lease {
  uint64_t id = 0;
  int64_t pid = -1, uid = -1;
  std::string device;
  std::chrono::system_clock::time_point since;
  std::map<std::string, uint64_t> reserved;  // what its client uses on a device, counted in that budget
  std::optional<uint64_t> peak;               // the most its client says it has used there
  std::string said;                           // the client's unfinished line
  // Follows its model's updates: the manifest of each new version is sent on `channel`, once
  // the client has said it took the one sent before ({"taken": VERSION}).
  bool follow = false;
  // Follows them in place (on a GPU): updates write into the memory it shares, and it is sent
  // only a line saying the new version, {"model", "lease", "version", "in_place": true}.
  bool in_place = false;
  std::shared_ptr<Channel> channel;
  uint64_t sent = 0, taken = 0;  // versions
};

struct Entry {
  Registry* registry = nullptr;
  std::string name;
  std::string file;
  std::string text;          // the file's content when last validated
  std::string serving_text;  // the content of the version in `config`
  std::optional<config::ModelConfig> config;
  std::optional<model::DryRun> dry;
  ModelState state = ModelState::Unloaded;
  std::string reason;        // why failed or invalid
  std::string config_error;  // a broken edit of the file while this version keeps serving
  // A valid edit of a loaded model, applied once the work in flight and queued before it ends.
  std::optional<std::pair<config::ModelConfig, model::DryRun>> replacement;

  std::shared_ptr<Runtime> runtime;  // handed to the worker while `busy`; the loop does not touch it
  std::unique_ptr<Worker> worker;
  bool busy = false;
  bool waiting_for_room = false;
  std::deque<Job> queue;
  std::vector<std::shared_ptr<Exchange>> load_watchers;  // streamed progress of the running load
  std::shared_ptr<std::atomic<bool>> cancel;            // of the running load
  std::shared_ptr<std::atomic<bool>> stop_forward;      // of the running forward
  LoadProgress progress;
  Clock::time_point progress_sent{};

  std::map<std::string, uint64_t> bytes;     // held on each device, as of the last job
  std::optional<model::VramStats> vram;      // streamed or partitioned weights' plan and counters, as of the last job
  DeviceBytes reserved;  // for the job running now (or about to run), on each device
  Clock::time_point last_used{};
  std::optional<std::chrono::milliseconds> keep_alive;
  uv_timer_t* keep_alive_timer = nullptr;
  bool removed = false;  // its file is gone: unload, then drop the entry
  // While any lease is held the model is never evicted, unloaded, offloaded or replaced.
  std::map<uint64_t, Lease> leases;

  // The memfds connections keep for the model's updates (KeptMemfd): counted in its cpu charge
  // while they are mapped. Expired ones are pruned as more come.
  std::vector<std::weak_ptr<KeptMemfd>> kept;

  uint64_t version = 0;  // of the loaded weights (Runtime::version), as of the last job
  uint64_t forwards = 0, forward_errors = 0, forwards_cancelled = 0, loads = 0, updates = 0;
  double forward_seconds = 0, load_seconds = 0, update_seconds = 0;
};

// What the entry counts against each device's budget, by part (server/charges.hpp): what its
// weights can hold in their state, what they hold past that, and what it holds back for its job
// and its leases' clients. `used` is the sum of these and of the values being freed.
Holdings charged(const Entry& entry);

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
  std::vector<const Entry*> entries() const;

  // Requests; each answers its exchange.
  void submit(Entry& entry, Job job);

  // Budgets and use per device (a model's own state becomes JSON in server/status.hpp).
  nlohmann::json devices_json() const;

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
  // end); throws Error with the numbers when it cannot fit.
  bool make_room(Entry& entry, const std::string& device, uint64_t bytes);
  // Room for what the entry will hold on each device (`expected`), less what it counts there
  // now, and for `extra` (a lease's room for its client), reserved for its next job: true once
  // reserved; else as make_room.
  bool reserve(Entry& entry, const DeviceBytes& expected, const DeviceBytes& extra = {});
  // The sum of every entry's charge on each device, and the values being freed (releasing_): one
  // pass over the entries, so that a question asked of each entry (holder_on) is not one pass each.
  DeviceBytes used() const;
  bool fits(const DeviceBytes& more, const DeviceBytes& used) const;  // beside `used`, within every budget
  Holder holder_on(const Entry& entry, const std::string& device, const DeviceBytes& used) const;  // server/eviction.hpp

  void touch(Entry& entry);
  void hand_over(Entry& entry, Job& job, const weights::Manifest& manifest);
  // After an update: each following lease of the entry gets the new version's manifest (a lease
  // job of the daemon's own each, run in the entry's queue).
  void refresh_followers(Entry& entry);
  // That job for one lease, if it follows, has taken the version sent before and is behind.
  void refresh(Entry& entry, Lease& lease);
  void send_refresh(Entry& entry, const Job& job, const Outcome& outcome);
  // `line` (and `fds`) to a following lease as its `version`; a client that has not taken the
  // version before, or is gone, follows no more.
  void send_version(const Entry& entry, Lease& lease, uint64_t version, const std::string& line,
                    const std::vector<int>& fds);
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
  bool shutting_down_ = false;
  size_t validations_in_flight_ = 0;
  bool rescan_after_drop_ = false;
  std::vector<std::function<void()>> scan_done_;
  uint64_t leases_made_ = 0;
  std::shared_ptr<int> alive_ = std::make_shared<int>();  // lease connections outliving the registry see it gone
};

}  // namespace vramd::server
