#include "weights/shared_region.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "util/error.hpp"

namespace vramd::weights {

std::shared_ptr<SharedRegion> SharedRegion::create(uint64_t size, const std::string& name) {
  const auto why = [&](const char* step) {
    return std::string(step) + " " + std::to_string(size) + " bytes of shared memory failed: " + std::strerror(errno);
  };
  if (size == 0) fail(name, "a shared region of 0 bytes");
  std::shared_ptr<SharedRegion> region(new SharedRegion);
  region->fd_ = UniqueFd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (region->fd_.get() < 0) fail(name, why("creating"));
  if (::ftruncate(region->fd_.get(), static_cast<off_t>(size)) != 0) fail(name, why("sizing"));
  region->size_ = size;
  void* write = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, region->fd_.get(), 0);
  if (write == MAP_FAILED) fail(name, why("mapping"));
  region->write_ = static_cast<std::byte*>(write);
  return region;
}

std::shared_ptr<SharedRegion> SharedRegion::adopt(UniqueFd fd, uint64_t size, const std::string& what) {
  if (size == 0) fail(what, "a shared region of 0 bytes");
  // Not populated: as with a checkpoint's mapping, a page is mapped in when it is first read.
  void* read = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (read == MAP_FAILED) fail(what, std::string("mapping it failed: ") + std::strerror(errno));
  std::shared_ptr<SharedRegion> region(new SharedRegion);
  region->fd_ = std::move(fd);
  region->size_ = size;
  region->read_ = static_cast<std::byte*>(read);
  return region;
}

SharedRegion::~SharedRegion() {
  if (write_) ::munmap(write_, size_);
  if (read_) ::munmap(read_, size_);
}

void SharedRegion::seal() {
  if (!write_) return;
  ::munmap(write_, size_);
  write_ = nullptr;
  if (::fcntl(fd_.get(), F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0)
    throw Error(std::string("sealing shared memory failed: ") + std::strerror(errno));
  void* read = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_.get(), 0);
  if (read == MAP_FAILED) throw Error(std::string("mapping sealed shared memory failed: ") + std::strerror(errno));
  read_ = static_cast<std::byte*>(read);
}

}  // namespace vramd::weights
