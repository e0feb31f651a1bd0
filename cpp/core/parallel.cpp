// cpp/core/parallel.cpp -- the shared pool behind parallel_for.
// One pool of (num_threads - 1) helpers serves every CPU device. A kernel asks for its share of
// cores: num_threads / (CPU devices busy now), so one device alone uses all cores and two busy
// devices use one each, with no oversubscription from BLAS (which runs single-threaded).
#include "core/parallel.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/queue.h"

namespace mgpu {
namespace {

constexpr int kMaxThreads = 1024;  // far above any machine's cores, far below what fails

thread_local bool t_in_parallel = false;

int default_threads() {
  if (const char* env = std::getenv("MGPU_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return std::min(n, kMaxThreads);
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// One parallel_for call. Helpers that start after the caller has finished (the pool was busy
// with another device's work) see `closed` and leave without touching fn.
struct Job {
  const std::function<void(int64_t)>* fn;
  int64_t n;
  std::atomic<int64_t> next{0};
  std::mutex mutex;
  std::condition_variable idle;
  int active = 0;
  bool closed = false;
  std::exception_ptr error;

  void work() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      try {
        (*fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
        next.store(n, std::memory_order_relaxed);  // stop handing out work
      }
    }
  }
};

class Pool {
 public:
  void ensure_threads(int count) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (static_cast<int>(threads_.size()) < count) {
      threads_.emplace_back([this] { loop(); });
      threads_.back().detach();  // lives for the process; see queue.cpp on shutdown
    }
  }
  void post(const std::shared_ptr<Job>& job, int copies) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (int i = 0; i < copies; ++i) jobs_.push_back(job);
    }
    if (copies == 1) has_work_.notify_one(); else has_work_.notify_all();
  }

 private:
  void loop() {
    block_async_signals();
    t_in_parallel = true;  // a nested parallel_for inside a helper runs serially
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        has_work_.wait(lock, [&] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      {
        std::lock_guard<std::mutex> lock(job->mutex);
        if (job->closed) continue;
        ++job->active;
      }
      job->work();
      {
        std::lock_guard<std::mutex> lock(job->mutex);
        --job->active;
      }
      job->idle.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable has_work_;
  std::deque<std::shared_ptr<Job>> jobs_;
  std::vector<std::thread> threads_;
};

std::atomic<int> g_threads{0};

Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

}  // namespace

int num_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  if (n == 0) {
    int d = default_threads();
    g_threads.compare_exchange_strong(n, d);
    n = g_threads.load();
  }
  return n;
}

void set_num_threads(int n) {
  // Threads start lazily, so an absurd count would fail much later, inside some op.
  MGPU_CHECK_VALUE(n >= 1 && n <= kMaxThreads, "set_num_threads: n must be in [1, ", kMaxThreads,
                   "], got ", n, "; this machine has ", std::thread::hardware_concurrency(),
                   " hardware threads");
  g_threads.store(n);
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  int share = num_threads() / std::max(1, busy_cpu_devices());
  int helpers = static_cast<int>(std::min<int64_t>(share - 1, n - 1));
  if (t_in_parallel || helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  pool().ensure_threads(num_threads() - 1);
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  pool().post(job, helpers);
  t_in_parallel = true;
  job->work();
  t_in_parallel = false;
  std::unique_lock<std::mutex> lock(job->mutex);
  job->closed = true;
  job->idle.wait(lock, [&] { return job->active == 0; });
  if (job->error) std::rethrow_exception(job->error);
}

void block_async_signals() {
  sigset_t set;
  sigfillset(&set);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT}) sigdelset(&set, sig);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

}  // namespace mgpu
