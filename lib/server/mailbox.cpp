#include "server/mailbox.hpp"

#include "server/boundary.hpp"

#include <pthread.h>

namespace vramd::server {

Mailbox::Mailbox(uv_loop_t* loop) : async_(new uv_async_t) {
  uv_async_init(loop, async_, on_async);
  async_->data = this;
}

Mailbox::~Mailbox() = default;

void Mailbox::post(std::function<void()> work) {
  std::lock_guard lock(mutex_);
  if (closed_) return;
  queue_.push_back(std::move(work));
  uv_async_send(async_);
}

void Mailbox::close() {
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  uv_close(reinterpret_cast<uv_handle_t*>(async_), [](uv_handle_t* handle) { delete reinterpret_cast<uv_async_t*>(handle); });
}

void Mailbox::on_async(uv_async_t* async) {
  auto* self = static_cast<Mailbox*>(async->data);
  std::vector<std::function<void()>> work;
  {
    std::lock_guard lock(self->mutex_);
    work.swap(self->queue_);
  }
  for (auto& item : work) guarded("work posted to the event loop", item);
}

Worker::Worker(const std::string& name) : thread_([this, name = name.substr(0, 15)] {
  pthread_setname_np(pthread_self(), name.c_str());
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    guarded("a job on a worker thread", job);
  }
}) {}

Worker::~Worker() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Worker::run(std::function<void()> job) {
  {
    std::lock_guard lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  wake_.notify_one();
}

}  // namespace vramd::server
