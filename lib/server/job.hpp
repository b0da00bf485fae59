// One request to one model (or the daemon's own: a preload, an eviction, a new config taking
// over), and what running it did. The registry (server/registry.hpp) keeps a queue of jobs per
// model and decides when each runs; run_job() is what a job does on the model's worker thread,
// where nothing of the registry is touched.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "config/model_config.hpp"
#include "model/vram_stats.hpp"
#include "server/http.hpp"
#include "server/runtime.hpp"
#include "weights/lease.hpp"

namespace vramd::server {

struct Job {
  enum class Kind { Load, Forward, Offload, Onload, Unload, Replace, Lease, Update } kind;
  std::shared_ptr<Exchange> exchange;  // null for the daemon's own jobs
  bool stream = false;                 // load: progress as newline-delimited JSON
  std::string input;                   // forward, update: safetensors bytes
  std::string path;                    // update: a checkpoint to read instead
  std::string memfd;                   // update: or the client's sealed memfd, /proc/PID/fd/N
  std::shared_ptr<KeptMemfd> kept;     // update: the memfd kept for the client's connection ({"keep": true})
  // Update (POST .../loras): the LoRA adapters to put in force instead of new values.
  std::optional<std::vector<config::LoraConfig>> loras;
  bool wait = true;                    // unload, offload: wait for the model's leases to end (else 409)
  bool hold = true;                    // lease: hand the connection over (else answer the manifest alone)
  bool follow = false;                 // lease: send the manifest of each new version after an update
  // Lease (on a GPU, following): updates write into the memory it shares, at the same addresses.
  // Update: the weights in a lease's GPU memory take their values there, as every lease held
  // takes updates so (or none is held).
  bool in_place = false;
  bool adapters = false;               // lease: its client applies the adapters the manifest lists
  std::optional<uint64_t> refresh;     // lease: the daemon's own, for following lease `refresh`
  std::string device = "cpu";          // lease: where the client wants the weights
  // Lease: what its client will use on a device, in that budget. Update: the room its new values
  // need beside the old ones, once a first run has said how much (Outcome::needs_room).
  std::map<std::string, uint64_t> reserve;
  // Forward: set once its client has gone, or at shutdown once the grace period is over; the
  // forward then stops before its next layer op.
  std::shared_ptr<std::atomic<bool>> stop;

  explicit Job(Kind kind, std::shared_ptr<Exchange> exchange = {}, bool stream = false)
      : kind(kind), exchange(std::move(exchange)), stream(stream) {}

  // "load", "forward", ...
  const char* name() const;
  // Loads the model first when it is not loaded.
  bool loads() const { return kind == Kind::Load || kind == Kind::Forward || kind == Kind::Lease; }
  // Needs the weights on the computation device: room is made for them before it runs.
  bool needs_weights() const { return loads() || kind == Kind::Onload || kind == Kind::Update; }
  // Takes the weights away: never while a client leases them.
  bool takes_weights() const { return kind == Kind::Unload || kind == Kind::Offload || kind == Kind::Replace; }
};

// What a job did, carried from its worker back to the loop.
struct Outcome {
  std::shared_ptr<Runtime> runtime;  // the model after the job: null once unloaded
  std::map<std::string, uint64_t> bytes;
  std::optional<model::VramStats> vram;
  model::FileSpans views;  // Runtime::views
  bool loaded = false;     // the job loaded the model
  std::string load_error;  // loading failed (the model is then unloaded)
  bool cancelled = false;  // a load by its progress callback, a forward by `stop`
  // The model's weights are not whole: a rank of a partitioned model died or stopped answering,
  // or a checkpoint was cut short under its mapped weights (storage::MappingLost).
  bool weights_lost = false;
  int status = 200;        // of the job's own answer
  std::string error;
  std::string output;      // forward: safetensors bytes
  std::shared_ptr<weights::Manifest> manifest;  // lease
  Runtime::Updated updated;                     // update
  // Update: the room its new values need beside the old ones, more than was reserved; nothing
  // changed, and the registry runs it again once that room is reserved.
  std::map<std::string, uint64_t> needs_room;
  // Update: the values it replaced (Runtime::take_replaced), for the registry to free off this
  // model's queue, and their bytes by device, which the budget counts until they are freed.
  std::shared_ptr<void> replaced;
  std::map<std::string, uint64_t> replaced_bytes;
  uint64_t version = 0;                         // of the weights after the job (0: not loaded)
  double seconds = 0, load_seconds = 0;
  Moved moved;
};

// Runs `job` on the model's worker thread: loads the model with `config` first when the job
// needs it and `runtime` is null (reporting to `progress`, which returns false to cancel), then
// does the job. Every failure is in the outcome; nothing throws.
Outcome run_job(Job& job, std::shared_ptr<Runtime> runtime, const config::ModelConfig& config,
                const std::function<bool(const LoadProgress&)>& progress);

}  // namespace vramd::server
