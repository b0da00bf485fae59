// What the daemon knows of one model: its config file and the version it serves, its state, its
// queue of jobs and its worker, what it holds and holds back, its leases. Owned by the registry
// (server/registry.hpp) and read on the loop thread only.
#pragma once

#include <uv.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "model/load_report.hpp"
#include "server/charges.hpp"
#include "server/http.hpp"
#include "server/job.hpp"
#include "server/mailbox.hpp"
#include "server/runtime.hpp"

namespace vramd::server {

class Registry;

enum class ModelState { Unloaded, Loading, Ready, Offloaded, Failed, Invalid };
const char* state_name(ModelState state);  // server/status.cpp

using Clock = std::chrono::steady_clock;

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
  std::string file;          // empty for a derived model
  // A model derived from another's config with a converter a client sent (POST .../derive,
  // server/derive.cpp): the other's name and the converter's text. It has no file of its own and
  // is removed when the other's config changes or goes.
  std::string derived_from;
  std::string derived_converter;
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
  model::FileSpans views;                    // of those bytes, the checkpoint's pages its weights view (server/budget.hpp)
  DeviceBytes reserved;  // for the job running now (or about to run), on each device
  Clock::time_point last_used{};
  std::optional<std::chrono::milliseconds> keep_alive;
  uv_timer_t* keep_alive_timer = nullptr;
  bool removed = false;  // its file is gone (derived: DELETE asked): unload, then drop the entry
  std::vector<std::shared_ptr<Exchange>> removal_watchers;  // the DELETEs answered once it is dropped
  // While any lease is held the model is never evicted, unloaded, offloaded or replaced.
  std::map<uint64_t, Lease> leases;

  // The memfds connections keep for the model's updates (KeptMemfd): counted in its cpu charge
  // while they are mapped. Expired ones are pruned as more come.
  std::vector<std::weak_ptr<KeptMemfd>> kept;

  uint64_t version = 0;  // of the loaded weights (Runtime::version), as of the last job
  uint64_t forwards = 0, forward_errors = 0, forwards_cancelled = 0, loads = 0, updates = 0;
  double forward_seconds = 0, load_seconds = 0, update_seconds = 0;
};

}  // namespace vramd::server
