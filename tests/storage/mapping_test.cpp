#include "storage/mapping.hpp"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <csignal>
#include <functional>

#include "storage/file.hpp"
#include "support/temp_dir.hpp"

using namespace vramd::storage;
using vramd::test::TempDir;

namespace {

constexpr size_t kPage = 4096;

// survive_cut_files() is for the whole process and for good, and a fault the handler passes on
// kills: each case runs in a child of its own. Returns the child's wait status.
int in_child(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(20);  // a handler that returned without mending the fault would fault for ever
    ::_exit(body());
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// The child's exit code (which step failed), or minus the signal that killed it.
int outcome(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status); }

// Killed by SIGBUS, or, under AddressSanitizer, reported by its SIGBUS handler (which this
// one passes faults on to) with exit status 1.
bool died_of_sigbus(int status) {
#if defined(__SANITIZE_ADDRESS__)
  return WIFEXITED(status) && WEXITSTATUS(status) == 1;
#else
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS;
#endif
}

std::string four_pages(const TempDir& dir) { return dir.write("weights.bin", std::string(4 * kPage, '\x7f')); }

// What File::check_mappings says: "" when nothing is lost, else MappingLost's message.
std::string lost(const File& file) {
  try {
    file.check_mappings();
    return "";
  } catch (const MappingLost& e) {
    return e.what();
  }
}

int sum(const std::byte* bytes, size_t n) {
  int total = 0;
  for (size_t i = 0; i < n; ++i) total += static_cast<int>(static_cast<const volatile std::byte*>(bytes)[i]);
  return total;
}

}  // namespace

TEST_CASE("a read-only range of a file cut short reads zeros and marks the file") {
  TempDir dir;
  const std::string path = four_pages(dir);
  CHECK(outcome(in_child([&] {
    survive_cut_files();
    const File file(path);
    const auto mapping = file.map_range(100, 4 * kPage - 200);
    if (sum(mapping->data() + 100, 10) != 10 * 0x7f) return 10;
    if (!lost(file).empty()) return 13;
    if (::truncate(path.c_str(), kPage) != 0) return 11;
    // The first page is still the file's; from the second on, the pages are gone.
    if (sum(mapping->data() + 100, 10) != 10 * 0x7f || sum(mapping->data() + 2 * kPage, kPage) != 0) return 12;
    return lost(file).starts_with(path + ": unexpected end of file") ? 0 : 14;
  })) == 0);
}

TEST_CASE("the whole file's private mapping, cut short, stays writable and is marked") {
  TempDir dir;
  const std::string path = four_pages(dir);
  CHECK(outcome(in_child([&] {
    survive_cut_files();
    const File file(path);
    const auto bytes = file.mapping();
    if (::truncate(path.c_str(), 0) != 0) return 10;
    if (sum(bytes.data() + 3 * kPage, kPage) != 0) return 11;
    bytes[3 * kPage] = std::byte{1};  // as any private mapping, after the zero page
    if (sum(bytes.data() + 3 * kPage, 2) != 1) return 12;
    return lost(file).empty() ? 13 : 0;
  })) == 0);
}

TEST_CASE("a fault outside every checkpoint mapping still kills") {
  TempDir dir;
  const std::string path = four_pages(dir);
  CHECK(died_of_sigbus(in_child([&] {
    survive_cut_files();
    const File file(path);  // a Mapping elsewhere is no cover for the one below
    const auto kept = file.map_range(0, kPage);
    void* other = ::mmap(nullptr, 4 * kPage, PROT_READ, MAP_SHARED, file.fd(), 0);
    if (::truncate(path.c_str(), kPage) != 0) return 10;
    return sum(static_cast<std::byte*>(other) + 2 * kPage, 1) + 20;
  })));
  CHECK(died_of_sigbus(in_child([&] {  // sent, not a fault
    survive_cut_files();
    ::kill(::getpid(), SIGBUS);
    return 0;
  })));
}

TEST_CASE("without survive_cut_files a lost page kills, as in any program") {
  TempDir dir;
  const std::string path = four_pages(dir);
  CHECK(died_of_sigbus(in_child([&] {
    const File file(path);
    const auto mapping = file.map_range(0, 4 * kPage);
    if (::truncate(path.c_str(), kPage) != 0) return 10;
    return sum(mapping->data() + 2 * kPage, 1) + 20;
  })));
}
