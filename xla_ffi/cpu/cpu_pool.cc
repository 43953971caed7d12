// The CPU kernels' worker threads (embark_ffi.h: CpuPoolRun, ParallelFor).
//
// Why not XLA's intra-op pool (ffi::ThreadPool)? Measured here, a task scheduled on it starts
// ~65 us later (its threads sleep between ops), so a kernel of 100-200 us ran on the calling
// thread alone. These workers instead spin for a short while (kSpin) after each job, then
// yield the CPU in a loop for a few milliseconds (kYield), as OpenMP's workers stay busy after
// a region, so kernel calls a few milliseconds apart find them awake; then they sleep on a
// condition variable and cost nothing.
//
// One job at a time: a call that finds the pool busy (several devices of one process calling
// kernels concurrently), or that comes from inside a job (a nested ParallelFor), runs its
// chunks on its own thread. Protocol: the caller publishes the
// job (job_, then gen_), takes chunks itself, waits until every chunk is done, unpublishes the
// job and waits until no worker is inside it (busy_ == 0). A worker announces itself in busy_
// before reading job_, so with sequentially consistent atomics it either sees the job while
// the caller still waits for it, or sees it unpublished: it never touches a returned call.
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "embark_ffi.h"

namespace embark {
namespace {

constexpr auto kSpin = std::chrono::microseconds(200);   // then yield the CPU while waiting
constexpr auto kYield = std::chrono::milliseconds(5);     // then sleep on the condition variable

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

thread_local bool t_in_job = false;  // a worker thread, or a caller inside Run

struct Job {
  void (*fn)(void*, int64_t);
  void* ctx;
  int64_t chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      fn(ctx, c);
      done.fetch_add(1);
    }
  }
};

// Threads this process may run on: the affinity mask, or EMBARK_CPU_THREADS if set (>= 1).
int64_t AvailableThreads() {
  if (const char* env = std::getenv("EMBARK_CPU_THREADS")) {
    const long v = std::strtol(env, nullptr, 10);
    if (v >= 1) return v;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const unsigned hc = std::thread::hardware_concurrency();
  return hc ? hc : 1;
}

class SpinPool {
 public:
  SpinPool() : threads_(AvailableThreads()) {
    for (int64_t t = 1; t < threads_; ++t) std::thread([this] { WorkerLoop(); }).detach();
  }

  int64_t threads() const { return threads_; }

  void Run(int64_t chunks, void (*fn)(void*, int64_t), void* ctx) {
    Job job{fn, ctx, chunks};
    if (t_in_job || threads_ <= 1) {  // nested, or alone: run it here
      job.Work();
      return;
    }
    std::unique_lock<std::mutex> submit(submit_mu_, std::try_to_lock);
    if (!submit.owns_lock()) {  // another caller has the workers
      job.Work();
      return;
    }
    t_in_job = true;
    job_.store(&job);
    gen_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    job.Work();
    while (job.done.load() < chunks) CpuRelax();
    job_.store(nullptr);
    while (busy_.load() != 0) CpuRelax();
    t_in_job = false;
  }

 private:
  void WorkerLoop() {
    t_in_job = true;
    uint64_t seen = gen_.load();
    for (;;) {
      seen = WaitForJob(seen);
      busy_.fetch_add(1);
      if (Job* job = job_.load()) job->Work();
      busy_.fetch_sub(1);
    }
  }

  // Spins, then yields, then sleeps, until gen_ moves past `seen`; returns the new generation.
  // Yielding keeps the worker awake (a sleeping worker took ~0.1-1 ms to wake here, so a
  // kernel called every few ms ran on its caller alone) while any other runnable thread, such
  // as XLA's own, gets the CPU: libgomp's workers likewise stay busy ~4 ms after a region.
  uint64_t WaitForJob(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      const uint64_t g = gen_.load();
      if (g != seen) return g;
      CpuRelax();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() - start > kSpin) break;
    }
    for (;;) {
      const uint64_t g = gen_.load();
      if (g != seen) return g;
      sched_yield();
      if (std::chrono::steady_clock::now() - start > kYield) break;
    }
    sleepers_.fetch_add(1);
    std::unique_lock<std::mutex> lock(sleep_mu_);
    wake_.wait(lock, [&] { return gen_.load() != seen; });
    sleepers_.fetch_sub(1);
    return gen_.load();
  }

  const int64_t threads_;
  std::mutex submit_mu_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> gen_{0};
  std::atomic<int64_t> busy_{0};
  std::atomic<int64_t> sleepers_{0};
  std::mutex sleep_mu_;
  std::condition_variable wake_;
};

SpinPool& Pool() {
  static SpinPool* pool = new SpinPool();  // never destroyed: workers outlive static teardown
  return *pool;
}

}  // namespace

int64_t CpuPoolThreads() { return Pool().threads(); }

void CpuPoolRun(int64_t chunks, void (*fn)(void*, int64_t), void* ctx) {
  Pool().Run(chunks, fn, ctx);
}

}  // namespace embark
