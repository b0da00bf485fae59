// Work for the event loop from other threads (results and progress of jobs), delivered
// through uv_async, and the threads that run each model's jobs in order.
#pragma once

#include <uv.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace vramd::server {

// What posted work and jobs throw is caught and logged (server/boundary.hpp): callers that
// owe someone an answer catch their own errors first, as the registry's jobs do.
class Mailbox {
 public:
  explicit Mailbox(uv_loop_t* loop);
  ~Mailbox();  // the handle must have been closed (close()) and the loop run since
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  void post(std::function<void()> work);  // any thread; runs on the loop thread
  void close();                           // loop thread

 private:
  static void on_async(uv_async_t* async);
  uv_async_t* async_;
  std::mutex mutex_;
  bool closed_ = false;  // posts after close() are dropped
  std::vector<std::function<void()>> queue_;
};

// One thread running jobs in the order given, named `name` (its first 15 bytes: what top -H,
// gdb and /proc/PID/task/TID/comm show, and what a test finds it by).
class Worker {
 public:
  explicit Worker(const std::string& name);
  ~Worker();  // finishes the jobs given, then joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void run(std::function<void()> job);

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace vramd::server
