// Tasks with dependencies, run by the CPU threads in the order they are taken (the chunk loop's
// schedule, vocab_parallel/chunk_loop.h). A task waits for counts that earlier tasks raise when they
// finish, so one parallel region runs them all: no barrier between the steps of the loop, where a
// thread that shares its core with another process would hold the others at every step.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

namespace fused_rl_ops {

class TaskQueue {
 public:
  explicit TaskQueue(int64_t counters) : counts_(new std::atomic<int64_t>[counters]()) {}

  // run_task(t) for each t < count, tasks taken in order by the threads of for_each (CpuGemms::
  // for_each_piece). Every task must wait only for tasks taken before it: a thread finishes the task
  // it took before it takes another, so the earliest unfinished task can always go on. The first
  // exception of a task is rethrown once every thread has stopped; the tasks after it are dropped.
  template <class ForEach, class RunTask>
  void run(int64_t count, const ForEach& for_each, const RunTask& run_task) {
    for_each(count, [&](int64_t t) {
      if (failed_.load(std::memory_order_relaxed)) return;
      try {
        run_task(t);
      } catch (const Abandoned&) {
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
        failed_.store(true);
      }
    });
    if (error_) std::rethrow_exception(error_);
  }

  // Waits until counter i has reached at_least, giving the core away meanwhile (a thread waits for
  // one that another process may hold off its core).
  void wait(int64_t i, int64_t at_least) const {
    while (counts_[i].load(std::memory_order_acquire) < at_least) {
      if (failed_.load(std::memory_order_relaxed)) throw Abandoned{};
      std::this_thread::yield();
    }
  }

  // Raises counter i by one, publishing what this thread wrote before to the threads that wait for it.
  void raise(int64_t i) const { counts_[i].fetch_add(1, std::memory_order_acq_rel); }

 private:
  struct Abandoned {};  // a task that waits when another one has failed stops
  std::unique_ptr<std::atomic<int64_t>[]> counts_;
  std::atomic<bool> failed_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace fused_rl_ops
