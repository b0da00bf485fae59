// A loaded model's weights: where they rest, how each layer's op gets them, sleep and wake. One
// interface with three kinds, chosen from the model config in one place (make_weights):
//   resident     every weight in its computation state for as long as the model is awake
//                (weights/resident.hpp)
//   streamed     layer by layer under [vram].limit, or prepared in a dtype of their own
//                (weights/streamed.hpp)
//   partitioned  1/N of each layer on each rank of a group, gathered while it runs
//                (weights/partitioned.hpp)
// Nothing outside lib/weights/ asks which kind a model has.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "model/load_report.hpp"
#include "model/layer.hpp"
#include "model/vram_stats.hpp"
#include "util/error.hpp"

namespace vramd::model {
class Model;
struct LoadOptions;
}  // namespace vramd::model

namespace vramd::weights {

class SharedRegion;
struct Source;

// One change of the bytes on the computation device, for plotting a forward.
struct VramEvent {
  double seconds;  // since the trace began
  uint64_t held;   // after the event
  const model::Layer* layer;
  const char* kind;  // "prefetch" (reserved), "ready", "acquire", "release", "evict"
};

// One rank's figures, for `vramctl run --stats-json`.
struct RankFigures {
  int64_t peak_rss = 0;      // of the process
  int64_t peak_weights = 0;  // most bytes of weights on the computation device
  int64_t share = 0;         // bytes of the weights this rank holds at rest (its slices)
  int64_t bytes_read = 0;    // of the checkpoint's tensor data (storage::DiskMap::bytes_read)
};

// New values for some weights (Weights::update). Each value is cast into fresh memory in its
// parameter's state, and only once all are there (and `check` has passed) do the parameters take
// them, so that a lease's client keeps the memory it mapped, with the values it had, and where
// the update fails nothing has changed. With `in_place` (the values are bytes that cannot change
// while they are copied: the request's own, a sealed memfd) a weight in memory of the daemon's
// own that nothing else holds takes its value where it is instead: the same outcome, without
// fresh memory.
struct WeightUpdate {
  std::vector<std::pair<model::Parameter*, at::Tensor>> values;  // CPU tensors of the parameters' shapes, any floating dtype
  bool in_place = false;
  // The values are views of sealed shared memory that lives as long as they do (a client's
  // memfd, SharedRegion::adopt): a weight resting in host memory in a value's dtype may keep the
  // view as its value, without a copy. ResidentWeights does so when every value allows it, and
  // otherwise copies them all: a memfd stays whole while any of its values is held.
  bool adopt = false;
  // No lease that keeps its values holds the model's GPU memory (every lease of it takes updates
  // in place, or none is held): weights in a lease's GPU regions (cuda::VmmRegion) take their
  // values where they are, so the regions keep their addresses and no fresh memory is needed on
  // the device. Values that may change while read (a checkpoint's mapping) are first copied
  // into host memory and checked.
  bool shared_in_place = false;
  // Bytes by device ("cpu", "cuda:0") the budget holds for fresh memory. Where the values need
  // more, the update throws UpdateNeedsRoom saying how much, before it allocates any.
  std::map<std::string, uint64_t> room;
  // Where set (the model has been leased on the host: server::Runtime), host values written
  // beside the old ones go into one new sealed region in place of fresh memory of the daemon's
  // own, given to `shared` once the weights hold them, so that the next lease hands that region
  // on where it would copy them into one of its own (LeaseMemory::adopt). ResidentWeights does so.
  std::function<void(std::shared_ptr<SharedRegion>)> shared;
  // Called once every value has been read, before any weight takes one; throws to leave them
  // as they were (a checkpoint cut short under its mapping: storage::MappingLost).
  std::function<void()> check;
  // Weights whose source changed (their adapters: a switch) and that are read from it anew at
  // each use wherever they are held (Weights::rereads): they take no value, and what holds a
  // value read before drops it, so that the next use reads the new one.
  std::vector<const model::Parameter*> reread;
};

// An update needs more fresh memory than WeightUpdate::room: bytes by device.
class UpdateNeedsRoom : public Error {
 public:
  explicit UpdateNeedsRoom(std::map<std::string, uint64_t> room) : Error("an update needs room"), room(std::move(room)) {}
  std::map<std::string, uint64_t> room;
};

// These weights cannot take an update as configured (the message says why and what to change): 409.
class NotUpdatable : public Error {
 public:
  using Error::Error;
};

// The refusal of an update to a weight held as packed GGUF blocks, whose values are not plain.
NotUpdatable packed_not_updatable(const std::string& model, const std::string& weight);

class Weights : public model::LayerWeights {
 public:
  // Sleep: every weight to the config's offload state (released when it is disk); the
  // computation device holds none. Wake: back to how loading left them. Both return the bytes
  // moved or read.
  virtual uint64_t sleep() = 0;
  virtual uint64_t wake() = 0;

  // The plan, bytes held, peak and streaming counters; none where the weights never move
  // while the model is awake.
  virtual std::optional<model::VramStats> stats() const = 0;
  // Bytes of weights held on each device ("cpu", "cuda:0"); nothing for weights on disk.
  virtual std::map<std::string, uint64_t> bytes_by_device() const = 0;
  // The checkpoint's bytes that weights held now are views of (pages of the page cache, counted
  // in bytes_by_device as well), and the copies on the host they share with other configs of
  // the checkpoint (spans named weights::copy_span): none where every value is a copy of its own.
  virtual model::FileSpans views() const { return {}; }

  // Throws NotLeasable (weights/lease.hpp) naming `model` and what to change in its config,
  // when a lease on `device` ("cpu", "cuda:0") cannot hand these weights over whole.
  virtual void check_leasable(const std::string& model, const std::string& device) const = 0;

  // New values for some of the weights, as one step (the model's jobs do not overlap it).
  // Throws NotUpdatable naming `model` and what to change.
  virtual void update(const std::string& model, const WeightUpdate& update) = 0;
  // Whether every copy of `parameter` is read from the checkpoint anew at each use (a layer
  // streamed from disk), so that a change of how it is read (its adapters) needs no value:
  // WeightUpdate::reread. Between the model's jobs, as update() is.
  virtual bool rereads(const model::Parameter&) const { return false; }
  // The values updates replaced, which the weights no longer use and hold until this is called: owned
  // by the pointer returned (freed with it, wherever the caller chooses), their bytes by device
  // added to `bytes`; null when there are none.
  virtual std::shared_ptr<void> take_replaced(std::map<std::string, uint64_t>&) { return {}; }

  // Records every change of the bytes on the computation device from now on, replacing an
  // earlier record; false where nothing changes while the model computes, or none is kept.
  virtual bool start_trace() { return false; }
  virtual std::vector<VramEvent> take_trace() { return {}; }

  // Where the weights are spread over a group: `peak_rss` and this rank's figures from every
  // rank, by rank (each rank must call it, in the same order as its other collectives).
  virtual std::optional<std::vector<RankFigures>> each_rank(int64_t /*peak_rss*/) { return std::nullopt; }
};

// What make_weights would plan for `config`, from the model's sizes alone (nothing is read):
// streamed weights' figures and plan line, as stats() shows them before the first forward; a
// model resting for its clients, its units and the limit each client keeps (which must hold the
// largest); none for resident weights, nor for partitioned ones (planned when their group loads them).
// Throws the Error make_weights would for a [vram] table it cannot honour.
std::optional<model::VramStats> plan_weights(const model::Model& model, const Source& source,
                                             const config::ModelConfig& config);
// The checkpoint's bytes that make_weights would hold as views of the file's pages, where its
// reads go through the page cache as `source` says, and the copies on the host it would share
// with other configs of the checkpoint, each a span of its own (weights/copy_key.hpp): views()
// once loaded.
model::FileSpans planned_views(const model::Model& model, const Source& source, const config::ModelConfig& config);

// Reads `model`'s weights from `source` as `config` says, reporting progress through `options`
// and figures into `report`. Throws Error naming the config when its [vram] or [partition]
// table cannot be honoured; model::Cancelled when the progress callback cancels the load.
std::shared_ptr<Weights> make_weights(model::Model& model, std::shared_ptr<Source> source,
                                      const config::ModelConfig& config, const model::LoadOptions& options,
                                      model::LoadReport& report);

}  // namespace vramd::weights
