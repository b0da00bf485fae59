#include "storage/mapping.hpp"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <mutex>

#include "storage/file.hpp"

namespace vramd::storage {
namespace {

// Every live Mapping, in a table the SIGBUS handler can read without a lock or an allocation.
// A slot is free (0), being filled or emptied (1) or live (2); the handler reads live ones only.
struct Slot {
  std::atomic<int> state{0};
  std::atomic<uintptr_t> begin{0}, end{0};  // page aligned
  std::atomic<bool> writable{false};
  std::atomic<std::atomic<bool>*> lost{nullptr};
};

constexpr size_t kSlots = size_t{1} << 16;
std::array<Slot, kSlots> slots;
std::atomic<size_t> slots_used{0};  // no live slot at or past this index
const uintptr_t page_size = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));  // at start-up, before any Mapping
struct sigaction previous_action {};

uintptr_t page_up(uintptr_t n) { return (n + page_size - 1) & ~(page_size - 1); }

size_t claim_slot(uintptr_t begin, uintptr_t end, bool writable, std::atomic<bool>* lost) {
  for (size_t i = 0; i < kSlots; ++i) {
    int free = 0;
    if (!slots[i].state.compare_exchange_strong(free, 1, std::memory_order_acquire)) continue;
    slots[i].begin.store(begin, std::memory_order_relaxed);
    slots[i].end.store(end, std::memory_order_relaxed);
    slots[i].writable.store(writable, std::memory_order_relaxed);
    slots[i].lost.store(lost, std::memory_order_relaxed);
    size_t used = slots_used.load();
    while (used < i + 1 && !slots_used.compare_exchange_weak(used, i + 1)) {
    }
    slots[i].state.store(2, std::memory_order_release);
    return i;
  }
  throw Error("more than " + std::to_string(kSlots) + " checkpoint mappings at once");
}

// As though this handler had never been installed: the previous one's turn, or the default
// action, which a fault raises again on return and a sent signal must be raised again for.
void pass_on(int signal, siginfo_t* info, void* context) {
  if (previous_action.sa_flags & SA_SIGINFO) {
    if (previous_action.sa_sigaction) return previous_action.sa_sigaction(signal, info, context);
  } else if (previous_action.sa_handler != SIG_DFL && previous_action.sa_handler != SIG_IGN) {
    return previous_action.sa_handler(signal);
  }
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(SIGBUS, &fallback, nullptr);
  if (info->si_code <= 0) ::raise(SIGBUS);  // sent, not a fault: it would not come again
}

// Async-signal-safe: atomics, and the mmap system call itself (not the libc or sanitizer
// wrappers) to put zero pages over the rest of the mapping, from the page that faulted on.
void on_sigbus(int signal, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  const size_t used = info->si_code > 0 ? slots_used.load(std::memory_order_acquire) : 0;
  for (size_t i = 0; i < used; ++i) {
    Slot& slot = slots[i];
    if (slot.state.load(std::memory_order_acquire) != 2) continue;
    const uintptr_t begin = slot.begin.load(std::memory_order_relaxed), end = slot.end.load(std::memory_order_relaxed);
    if (address < begin || address >= end) continue;
    const uintptr_t page = address & ~(page_size - 1);
    const int protection = slot.writable.load(std::memory_order_relaxed) ? PROT_READ | PROT_WRITE : PROT_READ;
    const long zeros = ::syscall(SYS_mmap, page, end - page, protection, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (zeros == -1) break;
    slot.lost.load(std::memory_order_relaxed)->store(true);
    errno = saved_errno;
    return;
  }
  errno = saved_errno;
  pass_on(signal, info, context);
}

}  // namespace

void survive_cut_files() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = &on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (::sigaction(SIGBUS, &action, &previous_action) != 0)
      throw Error(std::string("cannot install the SIGBUS handler: ") + std::strerror(errno));
  });
}

Mapping::Mapping(const std::string& path, int fd, uint64_t offset, size_t length, bool writable,
                 std::shared_ptr<std::atomic<bool>> lost)
    : size_(length), lost_(std::move(lost)) {
  const int protection = writable ? PROT_READ | PROT_WRITE : PROT_READ;
  void* address = ::mmap(nullptr, length, protection, writable ? MAP_PRIVATE : MAP_SHARED, fd, static_cast<off_t>(offset));
  if (address == MAP_FAILED)
    throw ReadFailure(path + ": cannot map " + std::to_string(length) + " bytes: " + std::strerror(errno));
  data_ = static_cast<std::byte*>(address);
  const auto begin = reinterpret_cast<uintptr_t>(address);
  try {
    slot_ = claim_slot(begin, page_up(begin + length), writable, lost_.get());
  } catch (...) {
    ::munmap(address, length);
    throw;
  }
}

Mapping::~Mapping() {
  slots[slot_].state.store(1, std::memory_order_release);
  ::munmap(data_, size_);
  slots[slot_].state.store(0, std::memory_order_release);
}

}  // namespace vramd::storage
