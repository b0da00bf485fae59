// One loaded model as the daemon holds it, behind a LibTorch-free interface: the daemon's
// event loop, registry and HTTP code never include ATen. Methods run on the model's worker
// thread, one at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config/model_config.hpp"
#include "model/load_report.hpp"
#include "model/vram_stats.hpp"
#include "util/error.hpp"
#include "weights/lease.hpp"

namespace vramd::dist {
class Group;
}

namespace vramd::server {

// A request's input is at fault (not the model or the daemon): HTTP 400.
class BadInput : public Error {
 public:
  using Error::Error;
};

// The model cannot do what the request asks as configured (the message says what to change): HTTP 409.
class Conflict : public Error {
 public:
  using Error::Error;
};

// An update's new values need more room beside the old ones than was reserved for it: bytes by
// device. Nothing has changed.
class NeedsRoom : public Error {
 public:
  explicit NeedsRoom(std::map<std::string, uint64_t> room) : Error("an update needs room"), room(std::move(room)) {}
  std::map<std::string, uint64_t> room;
};

// A memfd a client writes each of its updates of one model into ({"fd": N, "keep": true}),
// kept by the daemon for that client's connection: mapped once and, for a model with weights on
// a GPU, page-locked there once, so that each update after the first is copied to the device at
// the bus's speed. Runtime::update fills it; one update uses it at a time.
class KeptMemfd {
 public:
  KeptMemfd(std::string model, int64_t pid);
  ~KeptMemfd();
  KeptMemfd(const KeptMemfd&) = delete;
  KeptMemfd& operator=(const KeptMemfd&) = delete;

  const std::string model;  // whose updates it holds
  const int64_t pid;        // the client's process
  // What it holds now, for /v1/status and /metrics (any thread): the bytes mapped (0 before an
  // update has mapped one) and the GPUs they are page-locked for.
  struct Held {
    uint64_t bytes = 0;
    std::vector<std::string> page_locked;
  };
  Held held() const;

  struct State;  // runtime.cpp's

 private:
  friend class Runtime;
  std::unique_ptr<State> state_;
  mutable std::mutex mutex_;  // guards held_
  Held held_;
};

struct LoadProgress {
  uint64_t bytes_done = 0, bytes_total = 0;
  size_t tensors_done = 0, tensors_total = 0;
};

struct Moved {
  uint64_t bytes = 0;
  double seconds = 0;
};

class Runtime {
 public:
  // Throws Error; model::Cancelled (model/progress.hpp) when `progress` returns false.
  static std::unique_ptr<Runtime> load(const config::ModelConfig& config,
                                       const std::function<bool(const LoadProgress&)>& progress);
  ~Runtime();

  // On rank 0 of a group (dist/group.hpp): models with [partition] load across it, and every
  // load, forward, offload, onload and unload of one is sent to the other ranks first.
  static void use_group(std::shared_ptr<dist::Group> group);
  // On the other ranks: does what rank 0 sends (dist/commands.hpp), until rank 0 is gone.
  // Returns the exit status.
  static int follow(const config::DaemonConfig& config, std::shared_ptr<dist::Group> group);

  // Safetensors bytes of named inputs to safetensors bytes of the outputs. Throws BadInput
  // naming the input at fault, Error when the forward itself fails. Wakes an offloaded model.
  // Once `cancel` is set the forward stops before its next layer op and throws model::Cancelled;
  // a partitioned model's forward runs to its end, its ranks being in it together.
  std::string forward(std::string_view safetensors, const std::atomic<bool>* cancel = nullptr);

  // A lease's manifest on `device`: every weight in memory a client can map (weights/lease.hpp),
  // waking an offloaded model first; `applies_adapters`: the client adds the adapters the
  // manifest lists (config::clients_apply_adapters), which such a model's every lease must.
  // Throws BadInput for a device leases cannot use, weights::NotLeasable for a model whose
  // weights cannot all be shared, or whose adapters the client would leave out.
  weights::Manifest lease(const std::string& device, bool applies_adapters);

  struct Updated {
    size_t tensors = 0;
    uint64_t bytes = 0;  // of the new values, as the model holds them
    double seconds = 0;
    // From a kept memfd: "mapped" when this update mapped it, "reused" when an earlier one did;
    // and the GPUs it is page-locked for ("cuda:0").
    std::string kept;
    std::vector<std::string> page_locked;
    // set_loras: the adapters now in force.
    std::optional<std::vector<model::AdapterReport>> adapters;
  };
  // New values for some of the weights (POST /v1/models/NAME/weights), from one of: the bytes
  // of a safetensors file whose tensors are named as the model's parameters; a checkpoint
  // `path`, read as the config's (load::update_from_checkpoint); or a `memfd`
  // (/proc/PID/fd/N of the client's) holding such a safetensors file, sealed against writes and
  // shrinking, read where it lies; with `kept`, one sealed against shrinking alone, which the
  // client writes the next values into: mapped and page-locked once, kept in `kept` while it
  // stays the same file, read where it lies and never kept as the weights. `room`: bytes by device reserved for new values that cannot
  // be written where the old ones are (weights::WeightUpdate); `shared_in_place`: weights in a
  // lease's GPU memory take their values where they are, as no lease that keeps its values holds
  // it (weights::WeightUpdate::shared_in_place). Wakes an offloaded model. The
  // version goes up by one. Throws BadInput naming the tensor or file at fault, Conflict where
  // the weights cannot take an update, and NeedsRoom where they need more room than `room`, in
  // each case with nothing changed.
  Updated update(std::string_view safetensors, const std::string& path = {}, const std::string& memfd = {},
                 const std::map<std::string, uint64_t>& room = {}, bool shared_in_place = false,
                 KeptMemfd* kept = nullptr);
  // Replaces the LoRA adapters in force (the config's [[lora]] at load) with `loras` ([]
  // removes them all; POST /v1/models/NAME/loras) without a reload: load::switch_loras, as one
  // update, so the version goes up and a forward runs wholly on one set. `room` and
  // `shared_in_place` as for update. Wakes an offloaded model. Throws BadInput naming the adapter
  // and key, Conflict where the weights cannot take it (a partitioned model, layers streamed from
  // disk, weights held packed), NeedsRoom; in each case the adapters in force are kept.
  Updated set_loras(const std::vector<config::LoraConfig>& loras, const std::map<std::string, uint64_t>& room = {},
                    bool shared_in_place = false);
  // The values updates replaced (weights::Weights::take_replaced): freed when the pointer is
  // dropped, which may be on another thread while the model goes on; null when there are none.
  std::shared_ptr<void> take_replaced(std::map<std::string, uint64_t>& bytes);
  // 1 once loaded, one more for each update: the forward that answers and the lease that
  // hands over weights say which version they used.
  uint64_t version() const;

  Moved offload();  // every weight to the config's offload state
  Moved onload();   // back to the computation state
  bool offloaded() const;

  // Bytes of weights held on each device ("cpu", "cuda:0"); nothing for weights on disk.
  std::map<std::string, uint64_t> bytes_by_device() const;
  // Of those, the checkpoint's pages that weights are views of (weights::Weights::views).
  model::FileSpans views() const;
  // With [vram] management: the plan, the bytes held, the peak and the streaming counters.
  std::optional<model::VramStats> vram() const;
  const model::LoadReport& report() const;
  const std::string& dtype() const;

 private:
  struct Impl;
  explicit Runtime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace vramd::server
