// Collectives among the ranks of a group (dist/group.hpp) for one partitioned model: a Gloo
// process group under its own prefix of the group's store, so that each load starts afresh
// and a rank that died before can take part in the next one.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dist/group.hpp"

namespace vramd::dist {

class Communicator {
 public:
  // Every rank calls this with the same name. Waits for all of them up to `timeout`; throws
  // Error naming the ranks that did not join.
  Communicator(std::shared_ptr<Group> group, std::string name, std::chrono::milliseconds timeout);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  const std::string& name() const { return name_; }

  // A gather under way; wait() throws Error when a rank failed or did not answer in time.
  class Pending {
   public:
    Pending() = default;
    void wait();
    bool valid() const { return work_ != nullptr; }

   private:
    friend class Communicator;
    struct Work;
    std::shared_ptr<Work> work_;
    Communicator* owner_ = nullptr;
  };

  // Starts gathering every rank's `shard` (the same number of bytes on each, any dtype,
  // contiguous) into `output` (size() times those bytes), in rank order.
  Pending all_gather(const at::Tensor& output, const at::Tensor& shard);
  // Every rank's value, in rank order, once every rank has finished `step` (say "loading"):
  // when one does not, the error names it.
  std::vector<int64_t> all_gather_values(int64_t value, const std::string& step);

  // Records in the store that this rank finished `step`; missing() lists the ranks that have
  // not, for errors that say who is at fault.
  void mark(const std::string& step);
  std::vector<int> missing(const std::string& step);

  // Throws Error: "<name>: <during> failed on rank R of N: rank 1 did not finish <step> ...".
  [[noreturn]] void fail(const std::string& during, const std::string& cause, const std::string& step = {});

 private:
  std::string exited();
  struct Impl;
  std::shared_ptr<Group> group_;
  std::string name_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vramd::dist
