// vramctl's commands that talk to the daemon: list, status, load, unload, offload, onload,
// forward, lease, update, lora, reload. Each prints a human summary, or with --json the daemon's answer as it is.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace vramd::cli {

struct RemoteOptions {
  std::string socket;         // --socket; else $VRAMD_SOCKET, else the daemon config's
  std::string daemon_config;  // where to find the socket when neither is given
  bool json = false;
  std::string model;
  std::string keep_alive;  // load, forward: how long to keep the model after this request
  bool progress = true;    // load: show progress (a bar on a terminal, lines otherwise)
  // forward
  std::string input;                // safetensors file of named inputs
  std::vector<std::string> values;  // or name=1,2,3 (rows separated by ';')
  std::string output;               // write the outputs here; else print them
  bool wait = true;                 // unload, offload: wait for the model's leases to end (else refused)
  // lease
  std::string device = "cpu";
  bool hold = false;  // keep the lease until standard input ends
  // update
  std::string checkpoint;  // new values: a checkpoint the daemon reads (its path made absolute)
  bool body = false;       // send the file's bytes instead (a safetensors file of parameters)
  // lora
  std::vector<std::string> adapters;  // FILE[:SCALE], in order
  bool clear = false;                 // remove every adapter
};

// Returns the exit status; throws Error when the daemon cannot be reached.
int remote(const std::string& command, const RemoteOptions& options, std::ostream& out, std::ostream& err);

}  // namespace vramd::cli
