#include "storage/device_staging.hpp"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <vector>

#include "storage/file.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::storage {

// The buffers, and each one's copy out: queued on the reading thread's stream (from whichever
// thread takes the chunk), with an event recorded after it so the buffer is read into again
// only once the device has copied it.
class DeviceStaging::Pool final : public StagingPool {
 public:
  Pool(c10::Device device, unsigned count, uint64_t bytes)
      : device_(device), bytes_(bytes), count_(count), memory_(allocate(device, count * bytes)) {
    if (!device.is_cpu())
      for (unsigned i = 0; i < count; ++i) copied_.emplace_back(device.type());
  }

  ~Pool() override {
    for (unsigned i = 0; i < copied_.size(); ++i) wait(i);
  }

  // The read about to start: its targets' bytes, and the stream their copies go on.
  void begin(std::vector<at::Tensor> outs) {
    outs_ = std::move(outs);
    if (!device_.is_cpu()) stream_ = c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
  }

  uint64_t host_bytes() const { return memory_.nbytes(); }

  unsigned count() const override { return count_; }

  std::span<std::byte> buffer(unsigned i) override {
    return {static_cast<std::byte*>(memory_.mutable_data_ptr()) + i * bytes_, bytes_};
  }

  void take(const LandedChunk& chunk) override {
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
  // For a GPU, pinned memory from LibTorch's allocator (it rounds sizes up to a power of two,
  // as 16 buffers of 8 MiB are); its pages are aligned, and should they not be, one
  // alignment's slack is asked. On the CPU, memory mapped with huge pages, as every other
  // buffer O_DIRECT reads go into (fresh_buffer, load_tensors): the reads need fewer segments.
  static at::Tensor allocate(c10::Device device, uint64_t total) {
    const auto n = static_cast<int64_t>(total);
    if (device.is_cpu()) {
      void* memory = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (memory == MAP_FAILED) throw Error("cannot map " + format_bytes(total) + " of staging buffers: " + std::strerror(errno));
      madvise(memory, total, MADV_HUGEPAGE);
      return at::from_blob(memory, {n}, [total](void* p) { munmap(p, total); }, at::TensorOptions().dtype(c10::kByte));
    }
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
  at::Tensor memory_;                // the buffers, one after another, as bytes
  std::vector<c10::Event> copied_;   // per buffer; none on the CPU, where copies are made at once
  std::vector<at::Tensor> outs_;     // the targets' bytes, during a read
  std::optional<c10::Stream> stream_;
};

DeviceStaging::DeviceStaging(c10::Device device, unsigned buffers, uint64_t buffer_bytes)
    : device_(device), buffers_(buffers), buffer_bytes_(buffer_bytes) {}

DeviceStaging::~DeviceStaging() = default;

void DeviceStaging::read(const DiskMap& map, std::span<const Target> targets, bool direct) {
  std::vector<DiskMap::Staged> ranges;
  std::vector<at::Tensor> outs;
  for (const auto& target : targets) {
    const at::Tensor& out = target.out;
    if (out.device() != device_ || !out.is_contiguous())
      throw Error("a staged read's target must be a contiguous tensor on " + device_.str());
    ranges.push_back({target.file, target.offset, out.nbytes()});
    outs.push_back(out.view({-1}).view(c10::kByte));
  }
  if (!pool_) pool_ = std::make_unique<Pool>(device_, buffers_, buffer_bytes_);
  pool_->begin(std::move(outs));
  map.read_staged(ranges, *pool_, {.direct = direct, .depth = buffers_});
}

uint64_t DeviceStaging::host_bytes() const { return pool_ ? pool_->host_bytes() : 0; }

}  // namespace vramd::storage
