#include "model/allocations.hpp"

#include <c10/core/CPUAllocator.h>
#include <malloc.h>

#include <atomic>

namespace vramd::model {
namespace {

std::atomic<uint64_t> live{0};
std::atomic<uint64_t> peak{0};
c10::Allocator* inner = nullptr;
c10::DeleterFnPtr inner_delete = nullptr;

void note_peak(uint64_t now) {
  uint64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

// Sizes come from malloc_usable_size, at allocation and at free alike, so the two agree
// without a table of sizes: c10's CPU allocator takes its memory from posix_memalign.
void counted_delete(void* data) {
  if (data) live.fetch_sub(malloc_usable_size(data), std::memory_order_relaxed);
  inner_delete(data);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr memory = inner->allocate(bytes);
    void* data = memory.get();
    if (data) note_peak(live.fetch_add(malloc_usable_size(data), std::memory_order_relaxed) + malloc_usable_size(data));
    memory.release_context();  // the inner allocator's context is the data itself (checked at install)
    return {data, data, &counted_delete, memory.device()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* destination, const void* source, std::size_t bytes) const override {
    default_copy_data(destination, source, bytes);
  }
};

}  // namespace

bool count_cpu_allocations() {
  static const bool installed = [] {
    inner = c10::GetCPUAllocator();
    inner_delete = inner->raw_deleter();
    if (!inner_delete) return false;
    {
      c10::DataPtr probe = inner->allocate(64);  // data and context must be one pointer
      if (probe.get() != probe.get_context()) return false;
    }
    static CountingAllocator counting;
    c10::SetCPUAllocator(&counting, /*priority=*/100);
    return c10::GetCPUAllocator() == &counting;
  }();
  return installed;
}

AllocationCount cpu_allocations() { return {live.load(), peak.load()}; }

void reset_cpu_allocation_peak() { peak.store(live.load()); }

}  // namespace vramd::model
