#include "storage/device_staging.hpp"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#include "storage/file.hpp"
#include "util/cuda_vmm.hpp"
#include "util/error.hpp"
#include "util/format.hpp"
#include "util/log.hpp"

namespace vramd::storage {
namespace {

constexpr const char* kRegistered = "huge pages registered with the CUDA driver";

// Registered memory outlives its pool, kept for the next one as LibTorch keeps its pinned
// memory: page-locking and unlocking memory is ordered by the driver against every stream of
// the device (it would stall the other models' work), and every load makes a pool. A few are
// kept (as many as loads ran at once, up to four); never freed at exit, when the driver may
// be gone.
class KeptMemory {
 public:
  static KeptMemory& instance() {
    static auto* kept = new KeptMemory;
    return *kept;
  }
  // Memory of `bytes` registered for `device`, kept earlier, or an undefined tensor.
  at::Tensor take(c10::Device device, uint64_t bytes) {
    const std::lock_guard lock(mutex_);
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->device != device || it->memory.nbytes() != bytes) continue;
      at::Tensor memory = std::move(it->memory);
      kept_.erase(it);
      return memory;
    }
    return {};
  }
  void keep(c10::Device device, at::Tensor memory) {  // no copy may be reading it any more
    const std::lock_guard lock(mutex_);
    if (kept_.size() < 4) kept_.push_back({device, std::move(memory)});
  }

 private:
  struct Kept {
    c10::Device device;  // the one it was registered with (the memory is the host's)
    at::Tensor memory;
  };
  std::mutex mutex_;
  std::vector<Kept> kept_;
};

}  // namespace

// The buffers, and each one's copy out: queued on the reading thread's stream (from whichever
// thread takes the chunk), with an event recorded after it so the buffer is read into again
// only once the device has copied it.
class DeviceStaging::Pool final : public StagingPool {
 public:
  Pool(c10::Device device, unsigned count, uint64_t bytes, HostMemory memory)
      : device_(device), bytes_(bytes), count_(count), memory_(allocate(device, count * bytes, memory, kind_)) {
    if (!device.is_cpu())
      for (unsigned i = 0; i < count; ++i) copied_.emplace_back(device.type());
  }

  ~Pool() override {
    for (unsigned i = 0; i < copied_.size(); ++i) wait(i);
    if (kind_ == kRegistered) KeptMemory::instance().keep(device_, std::move(memory_));
  }

  // The read about to start: its targets' bytes, the stream their copies go on, and whether the
  // reading thread is in inference mode (a forward's, whose targets are then inference tensors).
  void begin(std::vector<at::Tensor> outs) {
    outs_ = std::move(outs);
    inference_ = c10::InferenceMode::is_enabled();
    if (!device_.is_cpu()) stream_ = c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
  }

  uint64_t host_bytes() const { return memory_.nbytes(); }
  const char* kind() const { return kind_; }

  unsigned count() const override { return count_; }

  std::span<std::byte> buffer(unsigned i) override {
    return {static_cast<std::byte*>(memory_.mutable_data_ptr()) + i * bytes_, bytes_};
  }

  void take(const LandedChunk& chunk) override {
    // As on the reading thread: LibTorch refuses to write an inference tensor outside that mode.
    const c10::InferenceMode mode(inference_);
    const auto from = static_cast<int64_t>(chunk.bytes.data() - static_cast<std::byte*>(memory_.mutable_data_ptr()));
    const auto n = static_cast<int64_t>(chunk.bytes.size());
    at::Tensor dst = outs_[chunk.range].narrow(0, static_cast<int64_t>(chunk.at), n);
    const at::Tensor src = memory_.narrow(0, from, n);
    if (!stream_) return void(dst.copy_(src));
    c10::StreamGuard on(*stream_);
    dst.copy_(src, /*non_blocking=*/true);
    copied_[chunk.buffer].record(*stream_);
  }

  bool done(unsigned i) override { return copied_.empty() || copied_[i].query(); }

  void wait(unsigned i) override {
    if (!copied_.empty()) copied_[i].synchronize();  // at once where nothing was recorded
  }

 private:
  static constexpr uint64_t kHugePage = 2u << 20;

  // `total` bytes at a huge page's boundary, advised to be huge pages; on a GPU registered with
  // the driver, or else (asked, or refused) pinned memory from LibTorch's allocator. Says which
  // in `kind`.
  static at::Tensor allocate(c10::Device device, uint64_t total, HostMemory memory, const char*& kind) {
    const auto n = static_cast<int64_t>(total);
    if (!device.is_cpu() && (!device.is_cuda() || memory == HostMemory::TorchPinned)) return pinned(n, kind);
    if (at::Tensor kept = KeptMemory::instance().take(device, total); kept.defined()) {
      kind = kRegistered;
      return kept;
    }
    const uint64_t length = total + kHugePage;
    void* mapping = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping == MAP_FAILED) throw Error("cannot map " + format_bytes(total) + " of staging buffers: " + std::strerror(errno));
    const auto address = reinterpret_cast<uintptr_t>(mapping);
    auto* start = reinterpret_cast<void*>((address + kHugePage - 1) / kHugePage * kHugePage);
    madvise(start, total, MADV_HUGEPAGE);
    std::shared_ptr<cuda::HostRegistration> registration;
    kind = "huge pages";
    if (device.is_cuda()) {
      try {
        registration = std::make_shared<cuda::HostRegistration>(device.index(), start, total);
        kind = kRegistered;
      } catch (const Error& e) {
        munmap(mapping, length);
        static std::once_flag said;  // a load makes a pool each time: say it once
        std::call_once(said, [&] {
          log::warn("staging buffers for " + device.str() + ": " + e.what() + "; LibTorch's pinned memory instead "
                    "(4 KiB pages, which O_DIRECT reads can fill several times slower)");
        });
        return pinned(n, kind);
      }
    }
    return at::from_blob(start, {n}, [mapping, length, registration](void*) mutable {
      registration.reset();  // unregistered before it is unmapped
      munmap(mapping, length);
    }, at::TensorOptions().dtype(c10::kByte));
  }

  // LibTorch's pinned memory: it rounds sizes up to a power of two, as 16 buffers of 8 MiB are;
  // its pages are aligned, and should they not be, one alignment's slack is asked.
  static at::Tensor pinned(int64_t n, const char*& kind) {
    kind = "LibTorch's pinned memory";
    const auto options = at::TensorOptions().dtype(c10::kByte).pinned_memory(true);
    at::Tensor memory = at::empty({n}, options);
    if (const auto address = reinterpret_cast<uintptr_t>(memory.mutable_data_ptr()); address % File::kDirectAlignment) {
      memory = at::empty({n + static_cast<int64_t>(File::kDirectAlignment)}, options);
      const auto at = reinterpret_cast<uintptr_t>(memory.mutable_data_ptr());
      memory = memory.narrow(0, static_cast<int64_t>(File::align_up(at) - at), n);
    }
    return memory;
  }

  c10::Device device_;
  uint64_t bytes_;                   // per buffer
  unsigned count_;
  const char* kind_ = "";            // what memory_ is (host_memory())
  at::Tensor memory_;                // the buffers, one after another, as bytes
  std::vector<c10::Event> copied_;   // per buffer; none on the CPU, where copies are made at once
  std::vector<at::Tensor> outs_;     // the targets' bytes, during a read
  bool inference_ = false;           // whether the reading thread is in inference mode
  std::optional<c10::Stream> stream_;
};

DeviceStaging::DeviceStaging(c10::Device device, unsigned buffers, uint64_t buffer_bytes, HostMemory memory)
    : device_(device), buffers_(buffers), buffer_bytes_(buffer_bytes), memory_(memory) {}

DeviceStaging::~DeviceStaging() = default;

at::Tensor DeviceStaging::target_bytes(const at::Tensor& out, const char* what) const {
  if (out.device() != device_ || !out.is_contiguous())
    throw Error(std::string("a staged ") + what + "'s target must be a contiguous tensor on " + device_.str());
  return out.view({-1}).view(c10::kByte);
}

DeviceStaging::Pool& DeviceStaging::pool() {
  if (!pool_) pool_ = std::make_unique<Pool>(device_, buffers_, buffer_bytes_, memory_);
  return *pool_;
}

void DeviceStaging::read(const DiskMap& map, std::span<const Target> targets, bool direct) {
  std::vector<DiskMap::Staged> ranges;
  std::vector<at::Tensor> outs;
  for (const auto& target : targets) {
    outs.push_back(target_bytes(target.out, "read"));
    ranges.push_back({target.file, target.offset, target.out.nbytes()});
  }
  pool().begin(std::move(outs));
  map.read_staged(ranges, *pool_, {.direct = direct, .depth = buffers_});
}

void DeviceStaging::copy(std::span<const HostCopy> copies) {
  std::vector<at::Tensor> outs;
  for (const auto& copy : copies) {
    outs.push_back(target_bytes(copy.out, "copy"));
    if (copy.bytes.size() != copy.out.nbytes())
      throw Error("a staged copy of " + format_bytes(copy.bytes.size()) + " into a tensor of " +
                  format_bytes(copy.out.nbytes()));
  }
  Pool& buffers = pool();
  buffers.begin(std::move(outs));
  unsigned next = 0;  // the buffers in turn: the one whose copy out was queued longest ago
  for (size_t range = 0; range < copies.size(); ++range) {
    const auto bytes = copies[range].bytes;
    for (uint64_t at = 0; at < bytes.size(); at += buffer_bytes_) {
      const unsigned i = next;
      next = (next + 1) % buffers_;
      buffers.wait(i);
      const auto chunk = buffers.buffer(i).first(std::min<uint64_t>(buffer_bytes_, bytes.size() - at));
      // On LibTorch's threads, as its copy_ does: reading a memfd just mapped faults its pages
      // in, which one thread does at a fraction of memcpy's speed.
      at::parallel_for(0, static_cast<int64_t>(chunk.size()), 1 << 20, [&](int64_t begin, int64_t end) {
        std::memcpy(chunk.data() + begin, bytes.data() + at + begin, static_cast<size_t>(end - begin));
      });
      buffers.take({range, at, chunk, i});
    }
  }
}

uint64_t DeviceStaging::host_bytes() const { return pool_ ? pool_->host_bytes() : 0; }

std::string DeviceStaging::host_memory() const { return pool_ ? pool_->kind() : "none"; }

}  // namespace vramd::storage
