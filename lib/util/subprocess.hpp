// Runs a program to its end: its standard input given, its output and errors kept, a deadline
// and a cap on what it may write. For the tools the daemon asks rather than links (the Python
// that writes transformers' conversion as a converter: load/transformers_rules.hpp).
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace vramd {

struct ProcessResult {
  int status = 0;       // the exit status; 128 + N when killed by signal N
  bool timed_out = false;  // killed at the deadline
  bool too_much = false;   // killed for writing more than it may
  std::string out, err;    // standard output; standard error (its last 64 KiB)
};

// Starts argv[0] (looked up on PATH when it has no slash) with `input` on its standard input and
// waits for it, for `timeout` at most, keeping at most `max_output` bytes of its standard output.
// Throws Error when it cannot be started (naming it and why).
ProcessResult run_process(const std::vector<std::string>& argv, const std::string& input,
                          std::chrono::milliseconds timeout, size_t max_output);

}  // namespace vramd
