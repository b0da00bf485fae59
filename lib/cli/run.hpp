// `vramctl run`: loads a model from its config without a daemon, runs one forward on named
// inputs from a safetensors file and writes the outputs to another. How users and tests check
// a config end to end.
#pragma once

#include <iosfwd>
#include <string>

namespace vramd::cli {

struct RunOptions {
  std::string config;
  std::string daemon_config;  // as for check
  std::string input;          // safetensors with the named inputs (input_ids, attention_mask, ...)
  std::string output;         // safetensors to write the outputs to; empty: print their shapes
  bool stats = false;         // timings, bytes and peak memory on stderr
  std::string stats_json;     // the same as one JSON object in this file
  int repeat = 1;             // forwards to run (timings report the first and the median)
  bool copy = false;          // read weights into owned memory rather than mapping the checkpoint
  int threads = 0;            // intra-op threads; 0: LibTorch's default
  std::string trace;          // JSON of every change of the weight bytes on the computation device in the last forward
};

// Throws vramd::Error naming the config, checkpoint key or input at fault.
void run(const RunOptions& options, std::ostream& out, std::ostream& err);

}  // namespace vramd::cli
