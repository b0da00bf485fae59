#include <catch2/catch.hpp>

#include "model/file_spans.hpp"

using vramd::model::FileSpans;

TEST_CASE("file spans merge overlapping and adjacent ranges, and count each byte once") {
  FileSpans spans;
  spans.add("1:2", 100, 200);
  spans.add("1:2", 300, 400);
  spans.add("1:2", 200, 250);  // adjacent to the first
  CHECK(spans.bytes() == 250);
  spans.add("1:2", 150, 350);  // joins all three
  CHECK(spans.bytes() == 300);
  spans.add("1:3", 100, 200);  // another file
  spans.add("1:3", 0, 0);      // empty: nothing
  CHECK(spans.bytes() == 400);
  FileSpans same;
  same.add("1:3", 100, 200);
  same.add("1:2", 100, 400);
  CHECK(same == spans);
}

TEST_CASE("file spans overlap only where one file's ranges meet") {
  FileSpans a, b;
  a.add("f", 0, 100);
  a.add("f", 200, 300);
  a.add("g", 0, 1000);
  b.add("f", 50, 250);
  b.add("h", 0, 1000);
  CHECK(a.overlap(b) == 100);  // [50, 100) and [200, 250)
  CHECK(b.overlap(a) == 100);
  CHECK(a.overlap(FileSpans{}) == 0);
  FileSpans both = a;
  both.add(b);
  CHECK(both.bytes() == a.bytes() + b.bytes() - a.overlap(b));
}

TEST_CASE("file spans name the files whose names begin with a prefix") {
  FileSpans spans;
  spans.add("copy:1", 0, 10);
  spans.add("copy:2", 0, 20);
  spans.add("8:1", 0, 100);
  FileSpans copies;
  copies.add("copy:1", 0, 10);
  copies.add("copy:2", 0, 20);
  CHECK(spans.named("copy:") == copies);
  CHECK(spans.named("copy:").bytes() == 30);
  CHECK(spans.named("none").empty());
  FileSpans pages;
  pages.add("8:1", 0, 100);
  CHECK(spans.named("copy:", false) == pages);
}
