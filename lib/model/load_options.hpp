// How a load runs: its progress callback, whether CPU weights may be views of the checkpoint's
// mapping, and the group a partitioned model loads across. Read by the loader (load/loader.hpp)
// and by the weights it makes (weights/weights.hpp).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "model/progress.hpp"

namespace vramd::dist {
class Group;
}

namespace vramd::model {

struct LoadOptions {
  // Called after each tensor; returning false (before the last one) cancels the load, which then throws Cancelled
  // and frees everything it allocated.
  std::function<bool(const Progress&)> progress;
  // CPU weights whose checkpoint bytes already have the right dtype and alignment are views of
  // the file's private mapping instead of copies. The file must then not be overwritten in
  // place while the model lives (replacing it by rename is fine).
  bool zero_copy = true;
  // For a config with [partition]: the group of processes to partition across (every rank
  // loads the same config with the same `partition_name`, which names its collectives).
  std::shared_ptr<dist::Group> group;
  std::string partition_name;
};

}  // namespace vramd::model
