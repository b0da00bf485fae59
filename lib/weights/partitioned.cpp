#include "weights/partitioned.hpp"

#include <ATen/ops/empty.h>

#include <fnmatch.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "convert/evaluate.hpp"
#include "dist/communicator.hpp"
#include "model/model.hpp"
#include "storage/tensor_io.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "weights/lease.hpp"
#include "weights/plan.hpp"
#include "weights/source.hpp"

namespace vramd::weights {

using model::Layer;
using model::Parameter;
using model::VramStats;

// Reads of slices gathered to be made together, several in flight (storage::read_ranges).
struct SliceReads {
  std::vector<storage::DiskMap::Range> ranges;
  std::vector<std::pair<at::Tensor, at::Tensor>> casts;  // read into the first, copied into the second

  void flush(const Source& source) {
    source.map.read_ranges(ranges, {.direct = source.direct});
    for (auto& [from, to] : casts) to.copy_(from);
    ranges.clear();
    casts.clear();
  }
};

namespace {

using Clock = std::chrono::steady_clock;

bool matches_any(const std::string& name, const std::vector<std::string>& patterns) {
  return std::any_of(patterns.begin(), patterns.end(),
                     [&](const std::string& pattern) { return fnmatch(pattern.c_str(), name.c_str(), 0) == 0; });
}

// A plain checkpoint tensor (not converted, not in blocks): its entry in the index.
const storage::TensorInfo* plain(const Source& source, const Assignment& assignment) {
  const convert::Expr& expr = *assignment.expr;
  if (expr.op != convert::Expr::Op::Source || assignment.patch) return nullptr;
  const auto& info = source.map.at(expr.source, expr.shard);
  return storage::dtype_block(info.dtype) == 1 ? &info : nullptr;
}

// Where element `element` of a plain tensor lies in its file.
uint64_t file_offset(const Source& source, const storage::TensorInfo& info, int64_t element) {
  return info.offset + static_cast<uint64_t>(element) * c10::elementSize(storage::scalar_type(source.map, info));
}

// CPU memory for `elements` read from the checkpoint, the first at `phase` in a page: huge pages
// at that phase for O_DIRECT (fewer segments a request, and the bytes land in place); plain
// memory for reads through the page cache, which are copies (huge pages would be zeroed as the
// copy faults them in: 0.3 s more for 1 GiB, bench/partition.py's checkpoint on 2 ranks).
at::Tensor read_buffer(const Source& source, int64_t elements, c10::ScalarType dtype, uint64_t phase) {
  return source.direct ? fresh_buffer({elements}, dtype, c10::kCPU, phase)
                       : at::empty({elements}, at::TensorOptions().dtype(dtype));
}

// Elements [begin, end) of the parameter's flattened value into `out` (CPU, contiguous, that
// many elements): of a plain checkpoint tensor, a read of exactly their bytes, queued in
// `reads`; otherwise, at once, the expression narrowed to the rows that hold them, read through
// the file mapping so that only the pages those rows touch are read.
void read_flat(const Source& source, const Assignment& assignment, int64_t begin, int64_t end, at::Tensor out,
               SliceReads& reads) {
  const convert::Expr& expr = *assignment.expr;
  const auto& map = source.map;
  if (assignment.patch) {  // its adapters change the whole weight: computed whole, then sliced
    out.copy_(source.read(assignment, c10::kCPU, c10::kFloat, true).reshape({-1}).narrow(0, begin, end - begin));
    return;
  }
  if (const storage::TensorInfo* info = plain(source, assignment)) {
    const c10::ScalarType stored = storage::scalar_type(map, *info);
    const uint64_t offset = file_offset(source, *info, begin);
    at::Tensor target =
        stored == out.scalar_type() ? out : read_buffer(source, end - begin, stored, direct_phase(offset, stored));
    reads.ranges.push_back({info->file, offset, {static_cast<std::byte*>(target.mutable_data_ptr()), target.nbytes()}});
    if (!target.is_same(out)) reads.casts.emplace_back(target, out);
    return;
  }
  if (expr.shape.empty() || expr.shape[0] == 0) {
    out.copy_(convert::evaluate(expr, map).reshape({-1}).narrow(0, begin, end - begin));
    return;
  }
  const int64_t row = assignment.parameter->elements() / expr.shape[0];
  const int64_t first = begin / row, last = (end + row - 1) / row;
  const at::Tensor rows = convert::evaluate(*convert::narrow(assignment.expr, 0, first, last - first), map).reshape({-1});
  out.copy_(rows.narrow(0, begin - first * row, end - begin));
}

uint64_t nbytes_on(const at::Tensor& tensor, c10::Device device) {
  return tensor.defined() && !tensor.is_meta() && tensor.device() == device ? tensor.nbytes() : 0;
}

}  // namespace

// One layer's partitioned parameters, flattened together.
struct PartitionedWeights::Unit {
  std::vector<Parameter*> parameters;
  std::vector<const Assignment*> parts;
  std::vector<int64_t> offsets;  // of each in the flat array
  int64_t elements = 0;          // S
  int64_t slice = 0;             // k = ceil(S / N)
  uint64_t bytes = 0;            // gathered, plus the computation copy when the dtypes differ
  at::Tensor held;               // this rank's slice at rest; undefined: on disk
  at::Tensor sent;               // the slice being sent, until the gather is done
  at::Tensor gathered;           // [N * k] on the computation device while gathered
  dist::Communicator::Pending pending;
  std::vector<at::Tensor> views;  // the parameters in the computation dtype, once gathered
  int users = 0;                  // ops holding it
  bool prefetched = false;
};

// Per parameter of a layer, the unit and index that hold it (a tied one: its leader's), or
// none for a replicated parameter, which is used as it is.
struct PartitionedWeights::Use {
  const Layer* layer = nullptr;
  std::vector<std::pair<Unit*, size_t>> parameters;
  std::vector<Unit*> units;  // each once
  size_t position = 0;       // in order_
};

PartitionedWeights::PartitionedWeights(model::Model& model, std::shared_ptr<Source> source,
                                       const config::ModelConfig& config, std::shared_ptr<dist::Communicator> communicator)
    : model_(model),
      source_(std::move(source)),
      config_(config),
      communicator_(std::move(communicator)),
      device_(torch_device(config.vram.computation.device)),
      dtype_(model.dtype()),
      limit_(config.vram.limit.value_or(UINT64_MAX)),
      slice_dtype_(state_dtype(config.vram.onload.dtype, model.dtype())) {
  std::map<const Parameter*, const Assignment*> assigned;
  for (const auto& a : source_->assignments) assigned[a.parameter] = &a;
  std::map<const Parameter*, std::pair<Unit*, size_t>> home;
  const int ranks = communicator_->size();
  for (const auto& layer : model.layers()) {
    auto unit = std::make_unique<Unit>();
    for (auto& parameter : layer->parameters()) {
      auto it = assigned.find(&parameter);
      if (parameter.tied || it == assigned.end()) continue;
      if (matches_any(parameter.name, config.partition.replicate)) {
        replicated_.push_back({&parameter, it->second});
        continue;
      }
      home[&parameter] = {unit.get(), unit->parameters.size()};
      unit->parameters.push_back(&parameter);
      unit->parts.push_back(it->second);
      unit->offsets.push_back(unit->elements);
      unit->elements += parameter.elements();
    }
    if (unit->parameters.empty()) continue;
    units_.push_back(std::move(unit));
  }
  std::vector<Layer*> managed;
  for (const auto& layer : model.layers()) {
    auto use = std::make_unique<Use>();
    use->layer = layer.get();
    for (const auto& parameter : layer->parameters()) {
      auto it = home.find(parameter.tied ? parameter.tied : &parameter);
      Unit* unit = it == home.end() ? nullptr : it->second.first;
      use->parameters.emplace_back(unit, it == home.end() ? 0 : it->second.second);
      if (unit && std::find(use->units.begin(), use->units.end(), unit) == use->units.end()) use->units.push_back(unit);
    }
    if (use->units.empty()) continue;
    managed.push_back(layer.get());
    uses_.push_back(std::move(use));
  }

  // The plan, from sizes alone, before anything is read.
  PartitionSizes sizes;
  sizes.ranks = ranks;
  sizes.slice_size = c10::elementSize(slice_dtype_);
  sizes.size = c10::elementSize(dtype_);
  sizes.copy = slice_dtype_ != dtype_;
  sizes.slices_on_device = config.vram.onload.device == config.vram.computation.device;
  std::map<const Unit*, size_t> index;
  for (const auto& unit : units_) {
    index[unit.get()] = sizes.elements.size();
    sizes.elements.push_back(static_cast<uint64_t>(unit->elements));
  }
  for (const auto& use : uses_) {
    auto& units = sizes.uses.emplace_back();
    for (const Unit* unit : use->units) units.push_back(index.at(unit));
  }
  for (const auto& [parameter, part] : replicated_) sizes.replicated += static_cast<uint64_t>(parameter->elements()) * sizes.size;
  const PartitionPlan plan = plan_partition(sizes, config);
  for (size_t i = 0; i < units_.size(); ++i) {
    units_[i]->slice = static_cast<int64_t>(plan.slice[i]);
    units_[i]->bytes = plan.bytes[i];
  }
  slice_bytes_ = plan.slices;

  materialise(config.vram.onload, device_);
  stats_.limit = config.vram.limit.value_or(0);
  stats_.resident = plan.resting;
  stats_.streaming = plan.largest;
  stats_.total = plan.resting + plan.largest;
  if (!sizes.slices_on_device && !config.vram.onload.device.is_disk()) stats_.onload = plan.slices;
  stats_.slots = uses_.size();
  count_held();
  stats_.plan = describe();
  for (Layer* layer : managed) layer->set_manager(this);
}

PartitionedWeights::~PartitionedWeights() {
  // A gather under way writes into buffers this rank owns: let it finish first.
  for (auto& unit : units_) try {
      unit->pending.wait();
    } catch (const std::exception&) {
    }
  for (const auto& layer : model_.layers()) layer->set_manager(nullptr);
}

// What is held on the computation device (counted as the limit is kept), and the slices resting
// anywhere else: in the onload state, or asleep in the offload state.
std::map<std::string, uint64_t> PartitionedWeights::bytes_by_device() const {
  std::map<std::string, uint64_t> bytes;
  if (stats_.held) bytes[device_.str()] = stats_.held;
  for (const auto& unit : units_)
    if (unit->held.defined() && unit->held.device() != device_) bytes[unit->held.device().str()] += unit->held.nbytes();
  return bytes;
}

// Every rank takes the same update (rank 0 hands its bytes to the others, server/runtime.cpp),
// checked the same way, and writes its own slice of each value where the slice rests: in
// place, which cannot fail once the values are read, so that no rank takes it without the others.
void PartitionedWeights::update(const std::string& model, const WeightUpdate& update) {
  std::map<const Parameter*, std::pair<Unit*, size_t>> home;
  for (const auto& unit : units_)
    for (size_t i = 0; i < unit->parameters.size(); ++i) home[unit->parameters[i]] = {unit.get(), i};
  if (!update.in_place)  // server::Runtime reads a path on rank 0 and hands every rank its bytes
    throw NotUpdatable("model " + quote(model) + " is partitioned across processes: it takes an update as bytes that " +
                       "rank 0 hands to every rank");
  for (const auto& [parameter, value] : update.values)
    if (const auto it = home.find(parameter); it != home.end() && !it->second.first->held.defined())
      throw NotUpdatable("model " + quote(model) + " rests its slices on disk ([vram].onload = disk), re-read from " +
                         "the checkpoint at each gather: they cannot take an update; rest them in memory to update it");
  if (update.check) update.check();
  for (auto& unit : units_)
    if (unit->gathered.defined() && unit->users == 0) drop(*unit);  // gathered from the version before
  for (const auto& [parameter, value] : update.values) {
    const auto it = home.find(parameter);
    if (it == home.end()) {  // replicated: whole on every rank
      parameter->value = value.to(parameter->value.device(), parameter->value.scalar_type(), false, /*copy=*/true);
      continue;
    }
    Unit& unit = *it->second.first;
    const int64_t offset = unit.offsets[it->second.second];
    const auto [begin, end] = own_elements(unit);
    const int64_t first = std::max(begin, offset), last = std::min(end, offset + parameter->elements());
    if (first < last)
      unit.held.narrow(0, first - begin, last - first).copy_(value.reshape({-1}).narrow(0, first - offset, last - first));
  }
  synchronise(device_);
  count_held();
}

void PartitionedWeights::check_leasable(const std::string& model, const std::string&) const {
  throw NotLeasable("model " + quote(model) + " is partitioned across processes ([partition].world_size), each holding " +
                    "a slice; a lease needs every weight in this one: remove [partition] from its config to lease it");
}

std::optional<std::vector<RankFigures>> PartitionedWeights::each_rank(int64_t peak_rss) {
  const auto rss = communicator_->all_gather_values(peak_rss, "reporting");
  const auto weights = communicator_->all_gather_values(static_cast<int64_t>(stats_.peak), "reporting");
  const auto shares = communicator_->all_gather_values(static_cast<int64_t>(slice_bytes()), "reporting");
  const auto read = communicator_->all_gather_values(static_cast<int64_t>(source_->map.bytes_read()), "reporting");
  std::vector<RankFigures> ranks;
  for (size_t r = 0; r < rss.size(); ++r) ranks.push_back({rss[r], weights[r], shares[r], read[r]});
  return ranks;
}

uint64_t PartitionedWeights::held_base() const {
  uint64_t bytes = 0;
  for (const auto& unit : units_) bytes += nbytes_on(unit->held, device_);
  for (const auto& [parameter, part] : replicated_) bytes += nbytes_on(parameter->value, device_);
  return bytes;
}

void PartitionedWeights::count_held() {
  stats_.held = held_base() + held_;
  stats_.peak = std::max(stats_.peak, stats_.held);
}

std::pair<int64_t, int64_t> PartitionedWeights::own_elements(const Unit& unit) const {
  const int64_t begin = communicator_->rank() * unit.slice;
  return {begin, std::min(begin + unit.slice, unit.elements)};
}

at::Tensor PartitionedWeights::read_slice(const Unit& unit, c10::ScalarType dtype, SliceReads& reads) const {
  const auto [begin, end] = own_elements(unit);
  // The slice starts at the phase of the first parameter it holds part of, read as stored.
  uint64_t phase = 0;
  for (size_t i = 0; i < unit.parameters.size(); ++i) {
    if (begin >= unit.offsets[i] + unit.parameters[i]->elements()) continue;
    const storage::TensorInfo* info = plain(*source_, *unit.parts[i]);
    if (info && storage::scalar_type(source_->map, *info) == dtype)
      phase = direct_phase(file_offset(*source_, *info, begin - unit.offsets[i]), dtype);
    break;
  }
  at::Tensor slice = read_buffer(*source_, unit.slice, dtype, phase);
  const int64_t filled = std::max<int64_t>(end - begin, 0);
  slice.narrow(0, filled, unit.slice - filled).zero_();  // the padding
  for (size_t i = 0; i < unit.parameters.size(); ++i) {
    const int64_t first = std::max(begin, unit.offsets[i]);
    const int64_t last = std::min(end, unit.offsets[i] + unit.parameters[i]->elements());
    if (first < last)
      read_flat(*source_, *unit.parts[i], first - unit.offsets[i], last - unit.offsets[i],
                slice.narrow(0, first - begin, last - first), reads);
  }
  return slice;
}

at::Tensor PartitionedWeights::read_slice(const Unit& unit, c10::ScalarType dtype) const {
  SliceReads reads;
  at::Tensor slice = read_slice(unit, dtype, reads);
  reads.flush(*source_);
  return slice;
}

// Slices into `state` (a device, or disk: released). Replicated parameters go to `home` (awake:
// the computation device, as every op uses them whole; none: released).
void PartitionedWeights::materialise(const config::DeviceState& state, std::optional<c10::Device> home) {
  const bool disk = state.device.is_disk();
  const c10::Device device = disk ? c10::Device(c10::kCPU) : torch_device(state.device);
  const auto dtype = state_dtype(state.dtype, slice_dtype_);
  // Slices from the checkpoint are read in groups of kReadGroupBytes, several reads in flight,
  // on the CPU; then each group goes to the device.
  constexpr uint64_t kReadGroupBytes = 256 << 20;
  SliceReads reads;
  std::vector<Unit*> group;
  uint64_t group_bytes = 0;
  const auto finish_group = [&] {
    try {
      reads.flush(*source_);
    } catch (...) {
      for (Unit* unit : group) unit->held = at::Tensor();  // not read: a gather reads it again
      throw;
    }
    for (Unit* unit : group) unit->held = unit->held.to(device);
    group.clear();
    group_bytes = 0;
  };
  for (auto& unit : units_) {
    if (disk) {
      unit->held = at::Tensor();
    } else if (unit->held.defined()) {
      unit->held = unit->held.to(device, dtype);
    } else {
      unit->held = read_slice(*unit, dtype, reads);
      group.push_back(unit.get());
      if ((group_bytes += unit->held.nbytes()) >= kReadGroupBytes) finish_group();
    }
  }
  finish_group();
  for (const auto& [parameter, part] : replicated_) {
    if (!home)
      parameter->value = at::empty(parameter->shape, at::TensorOptions().device(c10::kMeta).dtype(dtype_));
    else if (parameter->value.is_meta())
      parameter->value = source_->read(*part, *home, dtype_, false);
    else
      parameter->value = parameter->value.to(*home);
  }
  count_held();
}

uint64_t PartitionedWeights::resting_bytes() const {
  uint64_t bytes = 0;
  for (const auto& unit : units_) bytes += unit->held.defined() ? unit->held.nbytes() : 0;
  for (const auto& [parameter, part] : replicated_) bytes += parameter->value.is_meta() ? 0 : parameter->value.nbytes();
  return bytes;
}

void PartitionedWeights::start_gather(Unit& unit) {
  const at::Tensor slice = unit.held.defined() ? unit.held : read_slice(unit, slice_dtype_);
  unit.sent = slice.to(device_, slice_dtype_);
  unit.gathered = fresh_buffer({unit.slice * communicator_->size()}, slice_dtype_, device_);
  held_ += unit.bytes;
  count_held();
  stats_.loads++;
  stats_.bytes_streamed += unit.bytes;
  stats_.bytes_moved += unit.bytes;  // gathered as sliced
  unit.pending = communicator_->all_gather(unit.gathered, unit.sent);
}

void PartitionedWeights::finish_gather(Unit& unit) {
  const auto start = Clock::now();
  unit.pending.wait();
  stats_.wait_seconds += seconds_since(start);
  unit.sent = at::Tensor();
  unit.views.clear();
  for (size_t i = 0; i < unit.parameters.size(); ++i) {
    const Parameter& parameter = *unit.parameters[i];
    const at::Tensor view = unit.gathered.narrow(0, unit.offsets[i], parameter.elements()).view(parameter.shape);
    unit.views.push_back(view.scalar_type() == dtype_ ? view : view.to(dtype_));
  }
}

void PartitionedWeights::drop(Unit& unit) {
  unit.pending.wait();
  unit.sent = at::Tensor();
  unit.views.clear();
  unit.gathered = at::Tensor();
  unit.prefetched = false;
  held_ -= unit.bytes;
}

PartitionedWeights::Use& PartitionedWeights::use_of(const Layer& layer) {
  for (const auto& use : uses_)
    if (use->layer == &layer) return *use;
  throw Error("layer " + quote(layer.path()) + " is not partitioned");
}

// Every rank runs the same ops in the same order and makes the same decisions here, from byte
// counts alone, so the gathers line up across ranks.
std::vector<at::Tensor> PartitionedWeights::acquire(const Layer& layer) {
  Use& use = use_of(layer);
  if (order_.asked(&use)) stats_.order_learned = true;
  for (Unit* unit : use.units) {
    if (!unit->gathered.defined()) {
      // Gathered units no op holds (prefetched for an order that changed) give way first.
      for (auto& other : units_)
        if (held_base() + held_ + unit->bytes > limit_ && other->gathered.defined() && other->users == 0 &&
            std::find(use.units.begin(), use.units.end(), other.get()) == use.units.end())
          drop(*other);
      start_gather(*unit);
    } else if (unit->prefetched) {
      stats_.prefetched++;
      unit->prefetched = false;
    }
    if (unit->pending.valid()) finish_gather(*unit);
    unit->users++;
  }
  if (order_.learned()) prefetch_after(use);

  std::vector<at::Tensor> values;
  const auto parameters = layer.parameters();
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto [unit, index] = use.parameters[i];
    if (unit) {
      values.push_back(unit->views[index]);
      continue;
    }
    const Parameter& owner = parameters[i].tied ? *parameters[i].tied : parameters[i];
    if (owner.value.is_meta())
      throw Error("layer " + quote(layer.path()) + ": parameter " + quote(parameters[i].name) + " was never loaded");
    values.push_back(owner.value);
  }
  return values;
}

// Starts gathering the next layer's units while this one computes, when the limit has room.
void PartitionedWeights::prefetch_after(const Use& use) {
  if (use.position + 1 >= order_.size()) return;
  for (Unit* unit : order_[use.position + 1]->units) {
    if (unit->gathered.defined() || held_base() + held_ + unit->bytes > limit_) continue;
    start_gather(*unit);
    unit->prefetched = true;
  }
}

void PartitionedWeights::release(const Layer& layer) {
  for (Unit* unit : use_of(layer).units)
    if (--unit->users == 0 && !unit->prefetched) drop(*unit);
  count_held();
}

uint64_t PartitionedWeights::sleep() {
  for (auto& unit : units_)
    if (unit->gathered.defined()) drop(*unit);
  const uint64_t bytes = resting_bytes();
  const auto& offload = config_.vram.offload;
  materialise(offload, offload.device.is_disk() ? std::nullopt : std::optional(torch_device(offload.device)));
  return bytes;
}

uint64_t PartitionedWeights::wake() {
  materialise(config_.vram.onload, device_);
  return resting_bytes();
}

std::optional<VramStats> PartitionedWeights::stats() const {
  VramStats stats = stats_;
  stats.plan = describe();
  return stats;
}

std::string PartitionedWeights::describe() const {
  uint64_t replicated = 0;
  for (const auto& [parameter, part] : replicated_) replicated += static_cast<uint64_t>(parameter->elements()) * c10::elementSize(dtype_);
  const std::string rest = config_.vram.onload.device.is_disk() ? "read from disk at each gather" : "on " + config_.vram.onload.device.str();
  std::string text = "rank " + std::to_string(communicator_->rank()) + " of " + std::to_string(communicator_->size()) +
                     ": holds 1/" + std::to_string(communicator_->size()) + " of " + std::to_string(units_.size()) +
                     " layers (" + format_bytes(slice_bytes()) + " in " + storage::torch_name(slice_dtype_) + ", " + rest + ")";
  if (!replicated_.empty())
    text += " and " + std::to_string(replicated_.size()) + " replicated parameters (" + format_bytes(replicated) + ")";
  text += "; gathers each layer on " + device_.str() + " while it runs (largest " + format_bytes(stats_.streaming) + ")";
  text += stats_.order_learned ? ", the next one prefetched while the limit allows" : ", order not learned yet";
  if (stats_.limit) text += "; limit " + format_bytes(stats_.limit);
  text += "; peak " + format_bytes(stats_.peak);
  return text;
}

}  // namespace vramd::weights
