// What LibTorch's CPU allocator has handed out: on the CPU, the activations of a forward and
// the other temporaries of its ops. Weights are not among them where vramd maps their memory
// itself (streamed and gathered buffers) or maps the checkpoint; weights copied into owned
// memory are, and are live before the forward starts.
#pragma once

#include <cstdint>

namespace vramd::model {

// Puts a counting allocator in front of c10's CPU allocator, once per process; later calls do
// nothing. False when the allocator in place cannot be wrapped (its memory is not freed through
// a plain deleter), and then nothing is counted.
bool count_cpu_allocations();

struct AllocationCount {
  uint64_t live = 0;  // bytes handed out and not yet given back
  uint64_t peak = 0;  // the most live at once since the last reset
};
AllocationCount cpu_allocations();
void reset_cpu_allocation_peak();  // the peak starts again from what is live now

}  // namespace vramd::model
