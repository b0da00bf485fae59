#include "util/cuda_vmm.hpp"

#include "util/error.hpp"

#include <dlfcn.h>

#ifdef VRAMD_HAVE_CUDA_H
#include <cuda.h>
#include <fcntl.h>

#include <algorithm>
#include <mutex>
#endif

namespace vramd::cuda {

void* open_driver() {
  void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    const char* why = ::dlerror();
    throw Error(std::string("no CUDA driver here (") + (why ? why : "libcuda.so.1 not found") + ")");
  }
  return library;
}

#ifndef VRAMD_HAVE_CUDA_H

bool built_with_cuda_h() { return false; }

namespace {
[[noreturn]] void unavailable() {
  throw Error("this vramd was built without CUDA's cuda.h (from the CUDA toolkit or the torch wheel's nvidia "
              "packages), so it cannot share CUDA memory or register host memory; build it against a CUDA torch");
}
}  // namespace

std::shared_ptr<VmmRegion> VmmRegion::create(int, uint64_t) { unavailable(); }
std::shared_ptr<VmmRegion> VmmRegion::import(int, int, uint64_t, bool) { unavailable(); }
VmmRegion::~VmmRegion() = default;
HostRegistration::HostRegistration(int, void*, uint64_t, bool) { unavailable(); }
HostRegistration::~HostRegistration() = default;

#else

bool built_with_cuda_h() { return true; }

namespace {

#define VRAMD_STRING2(x) #x
#define VRAMD_STRING(x) VRAMD_STRING2(x)  // after expansion: cuda.h maps some names to their _v2
#define VRAMD_DRIVER_FUNCTIONS(X)                                                                          \
  X(cuInit) X(cuGetErrorName) X(cuDeviceGet) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease)      \
  X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuCtxSynchronize) X(cuMemGetAllocationGranularity) X(cuMemCreate) \
  X(cuMemRelease) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)   \
  X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) X(cuMemHostRegister) X(cuMemHostUnregister)

// The driver's functions, looked up once in libcuda.so.1.
struct Driver {
#define VRAMD_MEMBER(name) decltype(&::name) name = nullptr;
  VRAMD_DRIVER_FUNCTIONS(VRAMD_MEMBER)
#undef VRAMD_MEMBER
  std::string missing;  // why the driver cannot be used, or empty
};

std::string result_name(const Driver& d, CUresult result) {
  const char* name = nullptr;
  if (d.cuGetErrorName && d.cuGetErrorName(result, &name) == CUDA_SUCCESS && name) return name;
  return "CUresult " + std::to_string(static_cast<int>(result));
}

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* library = nullptr;
    try {
      library = open_driver();
    } catch (const Error& e) {
      d.missing = e.what();
      return;
    }
#define VRAMD_LOOKUP(name)                                                                   \
  d.name = reinterpret_cast<decltype(d.name)>(::dlsym(library, VRAMD_STRING(name)));         \
  if (!d.name && d.missing.empty()) d.missing = "the CUDA driver lacks " VRAMD_STRING(name) " (too old?)";
    VRAMD_DRIVER_FUNCTIONS(VRAMD_LOOKUP)
#undef VRAMD_LOOKUP
    if (d.missing.empty())
      if (const CUresult r = d.cuInit(0); r != CUDA_SUCCESS) d.missing = "cuInit failed: " + result_name(d, r);
  });
  if (!d.missing.empty()) throw Error(d.missing);
  return d;
}

void check(const Driver& d, CUresult result, int device, const std::string& what) {
  if (result != CUDA_SUCCESS)
    throw Error("cuda:" + std::to_string(device) + ": " + what + " failed: " + result_name(d, result));
}

// The device's primary context (PyTorch's) made current on this thread for a scope.
class PrimaryContext {
 public:
  explicit PrimaryContext(int device) : d_(driver()), index_(device) {
    check(d_, d_.cuDeviceGet(&device_, device), device, "cuDeviceGet");
    CUcontext context = nullptr;
    check(d_, d_.cuDevicePrimaryCtxRetain(&context, device_), device, "cuDevicePrimaryCtxRetain");
    if (const CUresult r = d_.cuCtxPushCurrent(context); r != CUDA_SUCCESS) {
      d_.cuDevicePrimaryCtxRelease(device_);
      check(d_, r, device, "cuCtxPushCurrent");
    }
  }
  ~PrimaryContext() {
    CUcontext popped = nullptr;
    d_.cuCtxPopCurrent(&popped);
    d_.cuDevicePrimaryCtxRelease(device_);
  }
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  const Driver& api() const { return d_; }
  int index() const { return index_; }

 private:
  const Driver& d_;
  int index_;
  CUdevice device_ = 0;
};

// Reserves an address range for `handle`'s first `size` bytes, maps them and sets this device's
// access: read-only when asked and allowed. Returns whether it is read-only.
bool map(const PrimaryContext& context, CUmemGenericAllocationHandle handle, uint64_t size, bool read_only,
         uint64_t& address, bool& mapped) {
  const Driver& d = context.api();
  const int device = context.index();
  CUdeviceptr reserved = 0;
  check(d, d.cuMemAddressReserve(&reserved, size, 0, 0, 0), device, "cuMemAddressReserve of " + std::to_string(size) + " bytes");
  address = reserved;
  check(d, d.cuMemMap(reserved, size, 0, handle, 0), device, "cuMemMap");
  mapped = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = read_only ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (read_only && d.cuMemSetAccess(reserved, size, &access, 1) == CUDA_SUCCESS) return true;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;  // the driver allows no read-only mapping here
  check(d, d.cuMemSetAccess(reserved, size, &access, 1), device, "cuMemSetAccess");
  return false;
}

}  // namespace

std::shared_ptr<VmmRegion> VmmRegion::create(int device, uint64_t size) {
  PrimaryContext context(device);
  const Driver& d = context.api();
  std::shared_ptr<VmmRegion> region(new VmmRegion);
  region->device_ = device;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t granularity = 0;
  check(d, d.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), device,
        "cuMemGetAllocationGranularity");
  const uint64_t rounded = (std::max<uint64_t>(size, 1) + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  check(d, d.cuMemCreate(&handle, rounded, &prop, 0), device, "cuMemCreate of " + std::to_string(rounded) + " bytes");
  region->handle_ = handle;
  region->size_ = rounded;
  int fd = -1;
  check(d, d.cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), device,
        "cuMemExportToShareableHandle");
  region->fd_ = UniqueFd(fd);
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);  // never inherited by a rank the daemon starts
  map(context, handle, rounded, false, region->address_, region->mapped_);
  return region;
}

std::shared_ptr<VmmRegion> VmmRegion::import(int device, int fd, uint64_t size, bool read_only) {
  PrimaryContext context(device);
  const Driver& d = context.api();
  std::shared_ptr<VmmRegion> region(new VmmRegion);
  region->device_ = device;
  CUmemGenericAllocationHandle handle = 0;
  check(d, d.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        device, "cuMemImportFromShareableHandle");
  region->handle_ = handle;
  region->size_ = size;
  region->read_only_ = map(context, handle, size, read_only, region->address_, region->mapped_);
  return region;
}

VmmRegion::~VmmRegion() {
  try {
    PrimaryContext context(device_);
    const Driver& d = context.api();
    d.cuCtxSynchronize();  // no kernel may still read what is unmapped
    if (mapped_) d.cuMemUnmap(address_, size_);
    if (address_) d.cuMemAddressFree(address_, size_);
    if (handle_) d.cuMemRelease(handle_);
  } catch (const Error&) {
    // The driver is gone (process exit): it freed everything already.
  }
}

HostRegistration::HostRegistration(int device, void* address, uint64_t size, bool read_only)
    : device_(device), address_(address) {
  PrimaryContext context(device);
  const unsigned flags = CU_MEMHOSTREGISTER_PORTABLE | (read_only ? CU_MEMHOSTREGISTER_READ_ONLY : 0);
  check(context.api(), context.api().cuMemHostRegister(address, size, flags), device,
        "cuMemHostRegister of " + std::to_string(size) + " bytes");
}

HostRegistration::~HostRegistration() {
  try {
    PrimaryContext context(device_);
    context.api().cuMemHostUnregister(address_);
  } catch (const Error&) {
    // The driver is gone (process exit): nothing is registered any more.
  }
}

#endif

}  // namespace vramd::cuda
