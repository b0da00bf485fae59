// Collectives among the ranks of a group (dist/group.hpp) for one partitioned model: a Gloo
// process group under its own prefix of the group's store, so that each load starts afresh
// and a rank that died before can take part in the next one. Its timeout ([partition] timeout)
// bounds each step: every rank joining, Gloo connecting them, and each gather.
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
  // Every rank calls this with the same name. Waits for all of them up to `timeout`, then for
  // Gloo to connect them up to `timeout` again; throws RankFailure naming the ranks that did not
  // join or answer, with the addresses they advertised.
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

  // Records in the store that this rank finished `step` (with its host, process and address);
  // missing() lists the ranks that have not, for errors that say who is at fault.
  void mark(const std::string& step);
  std::vector<int> missing(const std::string& step);

  // Throws RankFailure: "<name>: <during> failed on rank R of N: rank 1 did not finish <step>:
  // rank 1 (10.0.0.2 on node1) did not answer (<cause>); <advice>". The ranks named are those
  // that did not fail too within a moment; when the store is gone, rank 0, which serves it.
  [[noreturn]] void fail(const std::string& during, const std::string& cause, const std::string& step = {},
                         const std::string& advice = {});

 private:
  std::string rank0_gone(const std::string& how) const;
  std::string unanswered();
  struct Impl;
  std::shared_ptr<Group> group_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vramd::dist
