#include "server/runtime.hpp"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <map>

#include "config/daemon_config.hpp"
#include "convert/expr.hpp"
#include "dist/commands.hpp"
#include "dist/group.hpp"
#include "load/loader.hpp"
#include "load/lora.hpp"
#include "load/update.hpp"
#include "storage/file.hpp"
#include "storage/safetensors_header.hpp"
#include "storage/tensor_io.hpp"
#include "util/cuda_vmm.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/log.hpp"
#include "util/unique_fd.hpp"
#include "weights/source.hpp"
#include "weights/weights.hpp"

namespace vramd::server {

namespace {

std::shared_ptr<dist::Group>& the_group() {
  static std::shared_ptr<dist::Group> group;
  return group;
}

}  // namespace

struct Runtime::Impl {
  config::ModelConfig config;
  weights::LoadedModel loaded;
  std::string dtype;
  bool offloaded = false;
  std::shared_ptr<dist::Group> group;  // partitioned: the ranks it is split across
  std::string partition;               // and its name among them
  weights::LeaseMemory lease_memory;
  uint64_t version = 1;
  // After reading weights through the checkpoint's mappings: MappingLost if one lost pages.
  void check_mappings() const { loaded.source->map.check_mappings(); }
  void tell(const std::string& op, std::string_view input = {}) {
    if (group) dist::send_command(*group, op, partition, {}, input);
  }
};

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Runtime::~Runtime() {
  try {
    impl_->tell("unload");
  } catch (const std::exception&) {  // the other ranks are gone: nothing to tell
  }
}

void Runtime::use_group(std::shared_ptr<dist::Group> group) { the_group() = std::move(group); }

std::unique_ptr<Runtime> Runtime::load(const config::ModelConfig& config,
                                       const std::function<bool(const LoadProgress&)>& progress) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  model::LoadOptions options;
  if (config.partition.world_size > 1 && the_group()) {
    auto& group = *the_group();
    options.group = the_group();
    options.partition_name = dist::partition_name(group, config.name);
    dist::send_command(group, "load", options.partition_name, config.path);
    impl->group = the_group();
    impl->partition = options.partition_name;
  }
  if (progress)
    options.progress = [&](const model::Progress& p) {
      return progress({p.bytes_done, p.bytes_total, p.tensors_done, p.tensors_total});
    };
  impl->loaded = load::load_model(config, options);
  impl->check_mappings();
  impl->dtype = convert::dtype_torch_name(storage::dtype_of(impl->loaded.model->dtype()));
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}

namespace {

storage::NamedTensors parse_inputs(std::string_view body) {
  const auto* bytes = reinterpret_cast<const std::byte*>(body.data());
  storage::SafetensorsHeader header;
  try {
    header = storage::parse_safetensors_file({bytes, body.size()});
  } catch (const Error& e) {
    throw BadInput(std::string("request body is not a safetensors file: ") + e.what());
  }
  storage::NamedTensors inputs;
  for (const auto& record : header.tensors) {
    c10::ScalarType type;
    try {
      type = storage::scalar_type(record.dtype);
    } catch (const Error& e) {
      throw BadInput("input " + quote(record.name) + ": " + e.what());
    }
    at::Tensor tensor = at::empty(record.shape, at::TensorOptions().dtype(type));
    if (record.end > record.begin)  // an empty tensor may have no storage at all
      std::memcpy(tensor.data_ptr(), bytes + header.data_offset + record.begin, record.end - record.begin);
    inputs.emplace_back(record.name, std::move(tensor));
  }
  return inputs;
}

}  // namespace

std::string Runtime::forward(std::string_view safetensors, const std::atomic<bool>* cancel) {
  const auto inputs = parse_inputs(safetensors);
  if (impl_->offloaded) onload();
  impl_->tell("forward", safetensors);
  storage::NamedTensors outputs;
  try {
    c10::InferenceMode inference;
    model::CancelScope cancellable(impl_->group ? nullptr : cancel);
    outputs = impl_->loaded.model->forward(inputs);
  } catch (const model::Cancelled&) {
    throw;
  } catch (const c10::Error& e) {
    impl_->check_mappings();  // a file cut short explains the failure better than its symptom
    throw Error(std::string("forward failed: ") + e.what_without_backtrace());
  } catch (const dist::RankFailure&) {
    throw;
  } catch (const storage::ReadFailure&) {
    impl_->check_mappings();  // weights mapped before the cut may have lost pages too
    throw;                    // the checkpoint's fault, not the request's
  } catch (const Error& e) {
    impl_->check_mappings();
    throw BadInput(e.what());  // the model's checks of its inputs
  }
  impl_->check_mappings();  // weights read from a file cut short: no answer from them
  return storage::serialize_tensors(outputs, {{"model", impl_->config.name},
                                              {"produced_by", "vramd"},
                                              {"version", std::to_string(impl_->version)}});
}

weights::Manifest Runtime::lease(const std::string& device, bool applies_adapters) {
  // Spelled as the manifest and the leases list will spell it: "cuda" is not taken for "cuda:0".
  const auto parsed = config::Device::parse(device);
  if (!parsed || parsed->is_disk() || parsed->str() != device)
    throw BadInput("device " + quote(device) + ": expected \"cpu\" or \"cuda:N\"");
  const bool by_clients = config::clients_apply_adapters(impl_->config);
  if (by_clients && !applies_adapters)
    throw weights::NotLeasable("model " + quote(impl_->config.name) + " has its LoRA adapters applied by the clients that "
                               "manage it (architecture \"weights\", fuse_lora = false), and this lease did not say it "
                               "applies them: vramd.manage does; a lease with \"adapters\": true gets them listed in "
                               "its manifest (loras); fuse_lora = true hands the adapted values");
  if (!by_clients && !impl_->config.fuse_lora && !impl_->loaded.report.adapters.empty())
    throw weights::NotLeasable("model " + quote(impl_->config.name) + " computes its LoRA adapters beside its weights at each "
                               "op (fuse_lora = false), which a lease of the weights alone would leave out: fuse_lora = true "
                               "hands the adapted values");
  if (impl_->offloaded) onload();
  auto manifest = impl_->lease_memory.share(impl_->loaded, impl_->config.name, *parsed);
  if (config::rests_for_clients(impl_->config)) manifest.plan = weights::managed_plan(*impl_->loaded.model, *impl_->loaded.source, impl_->config);
  manifest.version = impl_->version;
  if (by_clients) manifest.loras = impl_->config.lora;
  impl_->check_mappings();
  return manifest;
}

struct KeptMemfd::State {
  dev_t device = 0;
  ino_t inode = 0;
  std::shared_ptr<weights::SharedRegion> region;
  bool taken = false;  // an update has taken values from `region` (one that needed room first ran twice)
  // By GPU ("cuda:0"): null where the driver refused (its updates then cross through staging
  // buffers). Declared after `region`, so unregistered before it is unmapped.
  std::map<std::string, std::unique_ptr<cuda::HostRegistration>> page_locked;
};

KeptMemfd::KeptMemfd(std::string model, int64_t pid)
    : model(std::move(model)), pid(pid), state_(std::make_unique<State>()) {}
KeptMemfd::~KeptMemfd() = default;

KeptMemfd::Held KeptMemfd::held() const {
  std::lock_guard lock(mutex_);
  return held_;
}

namespace {

// The client's memfd (/proc/PID/fd/N), opened here, its seals checked on this descriptor (the
// file mapped is the file checked): against writes and shrinking, or, for a memfd the daemon
// keeps, shrinking alone (nobody can cut it short under the mapping, but its client writes the
// next update's values into it).
OpenedFile open_memfd(const std::string& path, const std::string& what, bool kept) {
  OpenedFile opened;
  try {
    opened = open_regular_file(path);
  } catch (const Error& e) {
    throw BadInput(what + ": " + e.what());
  }
  UniqueFd fd(opened.fd);
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  const int needed = kept ? F_SEAL_SHRINK : F_SEAL_WRITE | F_SEAL_SHRINK;
  if (seals < 0 || (seals & needed) != needed)
    throw BadInput(what + (kept ? " is not sealed against shrinking (fcntl F_ADD_SEALS with F_SEAL_SHRINK): seal it, "
                                  "so that it cannot be cut short under the daemon's mapping"
                                : " is not sealed against writes and shrinking (fcntl F_ADD_SEALS with F_SEAL_WRITE | "
                                  "F_SEAL_SHRINK): seal it, so that it cannot change while the daemon reads it"));
  if (opened.size == 0) throw BadInput(what + " is empty");
  fd.release();
  return opened;
}

// A sealed memfd mapped read-only: nobody can change or cut it, so the weights may keep its
// pages as they are, and leases share it as a region of the daemon's own.
std::shared_ptr<weights::SharedRegion> adopt_sealed(const std::string& path, const std::string& what) {
  const OpenedFile opened = open_memfd(path, what, false);
  return weights::SharedRegion::adopt(UniqueFd(opened.fd), opened.size, what);
}

// Whether `path` is the memfd `kept` holds (the same file of the same size); else a state of
// its own for it, mapped read-only, which takes the kept one's place once an update from it is
// taken: until then the one kept stays as it was.
std::optional<KeptMemfd::State> open_kept(const KeptMemfd::State& kept, const std::string& path, const std::string& what) {
  const OpenedFile opened = open_memfd(path, what, true);
  UniqueFd fd(opened.fd);
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) throw BadInput(what + ": fstat: " + std::strerror(errno));
  if (kept.region && st.st_dev == kept.device && st.st_ino == kept.inode && opened.size == kept.region->size())
    return std::nullopt;
  KeptMemfd::State fresh;
  fresh.region = weights::SharedRegion::adopt(std::move(fd), opened.size, what);
  fresh.device = st.st_dev;
  fresh.inode = st.st_ino;
  return fresh;
}

// Page-locks the kept memfd for each GPU holding weights, once: copies from it then run at the
// bus's speed, with no staging buffer between (weights::write_values). Returns those GPUs. Only
// a memfd no larger than the weights and a header: page-locked memory cannot be swapped out,
// and values in another dtype than their weights' are cast on the host, never copied from it.
std::vector<std::string> page_lock(KeptMemfd::State& kept, const std::map<std::string, uint64_t>& held,
                                   const std::string& what) {
  constexpr uint64_t kHeader = 1 << 20;
  uint64_t weights = 0;
  for (const auto& [device, bytes] : held) weights += bytes;
  std::vector<std::string> locked;
  for (const auto& [device, bytes] : held) {
    if (!device.starts_with("cuda:")) continue;
    auto [it, fresh] = kept.page_locked.try_emplace(device);
    if (fresh && kept.region->size() > weights + kHeader) {
      log::info(what + " is not page-locked for " + device + ": its " + format_bytes(kept.region->size()) +
                " are more than the model's weights (" + format_bytes(weights) + "), so some of its values are "
                "in other dtypes, which cross through staging buffers once cast on the host");
    } else if (fresh) {
      try {
        it->second = std::make_unique<cuda::HostRegistration>(std::stoi(device.substr(5)),
                                                               const_cast<std::byte*>(kept.region->data()),
                                                               kept.region->size(), /*read_only=*/true);
      } catch (const Error& e) {
        log::info(what + " could not be page-locked for " + device + " (" + e.what() +
                  "); its updates cross to the device through staging buffers");
      }
    }
    if (it->second) locked.push_back(device);
  }
  return locked;
}

// Where an update's values may go: `room` by device, the GPU regions in place (`shared_in_place`),
// and, once the model has been leased on the host, a region of their own that the next lease
// hands on as it is (weights::WeightUpdate::shared).
load::UpdateSpace update_space(weights::LeaseMemory& memory, const std::map<std::string, uint64_t>& room, bool shared_in_place) {
  load::UpdateSpace space{room, shared_in_place, {}};
  if (memory.leased_on_host()) space.shared = [&memory](std::shared_ptr<weights::SharedRegion> region) { memory.adopt(region); };
  return space;
}

}  // namespace

Runtime::Updated Runtime::update(std::string_view safetensors, const std::string& path, const std::string& memfd,
                                 const std::map<std::string, uint64_t>& room, bool shared_in_place,
                                 KeptMemfd* kept) {
  const auto start = std::chrono::steady_clock::now();
  const load::UpdateSpace space = update_space(impl_->lease_memory, room, shared_in_place);
  if (impl_->offloaded) onload();
  load::UpdateReport report;
  Updated updated;
  try {
    // A partitioned model's other ranks take the same bytes once rank 0 has checked them.
    const auto from_bytes = [&](const std::byte* data, size_t size, const std::string& what,
                                std::shared_ptr<void> shared = {}, const load::UpdateSpace* in = nullptr) {
      const std::function<void()> tell = [&] { impl_->tell("update", {reinterpret_cast<const char*>(data), size}); };
      return load::update_from_bytes(impl_->loaded, impl_->config, {data, size}, what, in ? *in : space,
                                      impl_->group ? tell : std::function<void()>(), std::move(shared));
    };
    if (!memfd.empty() && kept) {
      // Read where it lies, never kept as the weights: its client writes the next values into it.
      // A memfd newly kept is counted in the cpu budget from then on: the update needs room for
      // it beside its new values' (load::UpdateSpace), and asks for both before anything changes.
      const std::string what = "the update's kept memfd " + quote(memfd);
      std::optional<KeptMemfd::State> fresh = open_kept(*kept->state_, memfd, what);
      KeptMemfd::State& state = fresh ? *fresh : *kept->state_;
      load::UpdateSpace values_space = space;
      if (fresh) {
        const uint64_t size = state.region->size();
        uint64_t& cpu = values_space.room["cpu"];
        if (cpu < size) {
          auto need = room;
          need["cpu"] = size;  // the first run of the update learns its memfd's size; the next, its values' room
          throw NeedsRoom(need);
        }
        cpu -= size;
      }
      updated.page_locked = page_lock(state, bytes_by_device(), what);
      try {
        report = from_bytes(state.region->data(), state.region->size(), what, {}, &values_space);
      } catch (const weights::UpdateNeedsRoom& e) {
        auto need = e.room;
        if (fresh) need["cpu"] += state.region->size();
        throw NeedsRoom(need);
      }
      if (fresh) *kept->state_ = std::move(*fresh);  // the memfd kept before is let go (unpinned, unmapped)
      {
        std::lock_guard lock(kept->mutex_);
        kept->held_ = {kept->state_->region->size(), updated.page_locked};
      }
      updated.kept = std::exchange(kept->state_->taken, true) ? "reused" : "mapped";
    } else if (!memfd.empty()) {
      const std::string what = "the update's memfd " + quote(memfd);
      const auto region = adopt_sealed(memfd, what);
      report = from_bytes(region->data(), region->size(), what, region);
      impl_->lease_memory.adopt(region);  // where the weights kept its pages, leases hand it on
    } else if (!path.empty() && impl_->group) {
      // Read here, on rank 0, whole: the other ranks take its bytes, which need not be on their hosts.
      const std::string read = load::checkpoint_as_safetensors(impl_->loaded, impl_->config, path);
      report = from_bytes(reinterpret_cast<const std::byte*>(read.data()), read.size(), "the update " + quote(path));
    } else if (!path.empty()) {
      report = load::update_from_checkpoint(impl_->loaded, impl_->config, path, space);
    } else {
      report = from_bytes(reinterpret_cast<const std::byte*>(safetensors.data()), safetensors.size(),
                          "the update's safetensors body");
    }
  } catch (const load::BadUpdate& e) {
    throw BadInput(e.what());
  } catch (const weights::NotUpdatable& e) {
    throw Conflict(e.what());
  } catch (const weights::UpdateNeedsRoom& e) {
    throw NeedsRoom(e.room);
  }
  impl_->version++;
  updated.tensors = report.tensors;
  updated.bytes = report.bytes;
  updated.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return updated;
}

Runtime::Updated Runtime::set_loras(const std::vector<config::LoraConfig>& loras, const std::map<std::string, uint64_t>& room,
                                    bool shared_in_place) {
  const auto start = std::chrono::steady_clock::now();
  if (impl_->group)
    throw Conflict("model " + quote(impl_->config.name) + " is partitioned: its ranks take adapters from its config ([[lora]]), "
                   "not at run time");
  if (impl_->offloaded) onload();
  load::UpdateReport report;
  Updated updated;
  try {
    updated.adapters = load::switch_loras(impl_->loaded, impl_->config, loras,
                                                 update_space(impl_->lease_memory, room, shared_in_place), report);
  } catch (const load::BadUpdate& e) {
    throw BadInput(e.what());
  } catch (const weights::NotUpdatable& e) {
    throw Conflict(std::string(e.what()) + "; the adapters in force are kept");
  } catch (const weights::UpdateNeedsRoom& e) {
    throw NeedsRoom(e.room);
  }
  impl_->config.lora = loras;  // a wake or a re-read from the checkpoint takes this set too
  impl_->version++;
  updated.tensors = report.tensors;
  updated.bytes = report.bytes;
  updated.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return updated;
}

std::shared_ptr<void> Runtime::take_replaced(std::map<std::string, uint64_t>& bytes) {
  return impl_->loaded.weights->take_replaced(bytes);
}

uint64_t Runtime::version() const { return impl_->version; }

Moved Runtime::offload() {
  if (impl_->offloaded) return {};
  impl_->tell("offload");
  const auto moved = load::offload(impl_->loaded);
  impl_->offloaded = true;
  return {moved.bytes, moved.seconds};
}

Moved Runtime::onload() {
  if (!impl_->offloaded) return {};
  impl_->tell("onload");
  const auto moved = load::onload(impl_->loaded);
  impl_->offloaded = false;
  impl_->check_mappings();
  return {moved.bytes, moved.seconds};
}

bool Runtime::offloaded() const { return impl_->offloaded; }

std::map<std::string, uint64_t> Runtime::bytes_by_device() const { return impl_->loaded.weights->bytes_by_device(); }
model::FileSpans Runtime::views() const { return impl_->loaded.weights->views(); }

std::optional<model::VramStats> Runtime::vram() const { return impl_->loaded.weights->stats(); }

int Runtime::follow(const config::DaemonConfig& daemon, std::shared_ptr<dist::Group> group) {
  const std::string me = "vramd rank " + std::to_string(group->rank()) + ": ";
  std::map<std::string, weights::LoadedModel> models;
  std::map<std::string, config::ModelConfig> configs;
  dist::CommandReader commands(group);
  if (commands.first() > 1) std::cerr << me << "rejoined the group at command " << commands.first() << '\n';
  while (const auto command = commands.next()) {
    const std::string& op = command->op;
    try {
      if (op == "load") {
        model::LoadOptions options;
        options.group = group;
        options.partition_name = command->model;
        auto config = config::load_model_config(command->config, daemon);
        models[command->model] = load::load_model(config, options);
        configs[command->model] = std::move(config);
        continue;
      }
      auto found = models.find(command->model);
      if (found == models.end()) continue;  // its load failed here already, and said why
      if (op == "unload") models.erase(found), configs.erase(command->model);
      else if (op == "offload") load::offload(found->second);
      else if (op == "onload") load::onload(found->second);
      else if (op == "update")
        load::update_from_bytes(found->second, configs.at(command->model),
                                 {reinterpret_cast<const std::byte*>(command->input.data()), command->input.size()},
                                 "rank 0's update", {});
      else if (op == "forward") {
        c10::InferenceMode inference;
        found->second.model->forward(parse_inputs(command->input));
      }
    } catch (const std::exception& e) {
      std::cerr << me << op << " of " << command->model << " failed: " << e.what() << '\n';
    }
  }
  std::cerr << me << "rank 0 is gone (" << commands.gone() << "); exiting\n";
  return 0;
}

const model::LoadReport& Runtime::report() const { return impl_->loaded.report; }
const std::string& Runtime::dtype() const { return impl_->dtype; }

}  // namespace vramd::server
