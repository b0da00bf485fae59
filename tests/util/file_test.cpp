#include "util/file.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>

#include "support/temp_dir.hpp"
#include "util/error.hpp"

using namespace vramd;
using Catch::Matchers::Contains;

TEST_CASE("A regular file is read whole") {
  test::TempDir dir;
  const auto path = dir.write("a.toml", "name = \"a\"\n");
  CHECK(read_regular_file(path, 100) == "name = \"a\"\n");
  std::filesystem::create_symlink(path, dir / "link.toml");
  CHECK(read_regular_file(dir / "link.toml", 100) == "name = \"a\"\n");
}

TEST_CASE("What is not a regular file is refused at once, naming what it is") {
  test::TempDir dir;
  REQUIRE(::mkfifo((dir / "fifo.toml").c_str(), 0600) == 0);
  const auto started = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(read_regular_file(dir / "fifo.toml", 100), Contains("fifo.toml: is a FIFO, not a regular file"));
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(1));  // no writer was waited for
  CHECK_THROWS_WITH(read_regular_file("/dev/zero", 100), Contains("/dev/zero: is a character device"));
  CHECK_THROWS_WITH(read_regular_file(dir.path().string(), 100), Contains("is a folder"));
  std::filesystem::create_symlink("loop.toml", dir / "loop.toml");
  CHECK_THROWS_WITH(read_regular_file(dir / "loop.toml", 100), Contains("Too many levels of symbolic links"));
  std::filesystem::create_symlink("nowhere", dir / "dangling.toml");
  CHECK_THROWS_WITH(read_regular_file(dir / "dangling.toml", 100), Contains("No such file"));
}

TEST_CASE("A file over the cap is refused with the cap, and its name is escaped") {
  test::TempDir dir;
  const auto path = dir.write("big\xff.toml", std::string(2048, 'x'));
  CHECK_THROWS_WITH(read_regular_file(path, 1024), Contains("big\\xff.toml: is larger than 1.00 KiB"));
}
