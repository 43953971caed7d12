// The CPU kernels' worker threads (embark_ffi.h: CpuPoolRun, ParallelFor).
//
// Why not XLA's intra-op pool (ffi::ThreadPool)? Its threads sleep between ops, so a task
// scheduled on it starts late and a kernel of a few hundred microseconds runs on the calling
// thread alone (docs/benchmarks.md has the measurements). These workers can instead stay
// awake after each job (EMBARK_CPU_SPIN, opt-in: spin kSpin, then yield the CPU until kYield,
// as OpenMP's workers stay busy after a region), so kernels a few milliseconds apart find
// them running; otherwise, and after that, they sleep on a condition variable and cost
// nothing.
//
// A worker on the caller's CPU cannot help it: woken from sleep, the OS may place it on the
// caller's CPU, where it preempts the caller or, yielding, takes no chunk while another CPU
// sits idle. So a worker publishes the CPU it waits on, and a caller moves each worker
// published on its own CPU (and every sleeper) onto the process's other CPUs
// (sched_setaffinity on the worker's thread id) before it publishes a job; a worker that
// still picks up a job on its caller's CPU moves itself off, and takes back its whole mask
// before it sleeps. The masks are the pool's, set from the process's mask when the pool
// starts, so a binding of the workers from outside afterwards (taskset -a -p, numactl) lasts
// only until a worker next sleeps.
//
// Each thread has a share of a job's chunks: the caller the first 1/T of them, worker t the
// t-th (T threads). It takes its own share in order, then whatever is left of the others'
// (a late or absent worker's share is done by the rest), claiming each chunk from its share's
// counter, a cache line of its own. So a job's chunks do not bounce one counter between the
// CPUs, and in steady state each thread writes the same part of an output call after call,
// which stays in its own cache.
//
// One job at a time: a call that finds the pool busy (several devices of one process calling
// kernels concurrently), or that comes from inside a job (a nested ParallelFor), runs its
// chunks on its own thread. Protocol: the caller sets the shares, publishes the job (job_,
// then gen_), takes chunks until every share is spent, unpublishes the job and waits until no
// worker is inside it (busy_ == 0): a worker still in a chunk holds busy_ until the chunk is
// done. A worker announces itself in busy_ before reading job_, so with sequentially
// consistent atomics it either sees the job while the caller still waits for it, or sees it
// unpublished: it never touches a returned call, and the shares are set again only when no
// worker is inside a job.
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>

#include "embark_ffi.h"

namespace embark {
namespace {

constexpr auto kSpin = std::chrono::microseconds(200);   // then yield the CPU while waiting
constexpr auto kYield = std::chrono::milliseconds(5);     // then sleep on the condition variable

// Whether workers spin and yield before they sleep (EMBARK_CPU_SPIN, set by Python when the
// kernels load): opt-in, since awake workers take CPU time from the rest of the process.
std::atomic<bool> g_spin{false};

// The floating-point mode of SSE/AVX arithmetic (MXCSR: rounding, flush-to-zero and
// denormals-are-zero). XLA runs its CPU code, ours included, with subnormals flushed to zero;
// a worker computes its chunks in its caller's mode, so a result never depends on which
// thread took a chunk (a worker inherits its creator's mode, which need not be a later
// caller's). 0 where there is no such register.
inline unsigned FpMode() {
#if defined(__x86_64__) || defined(__i386__)
  return _mm_getcsr();
#else
  return 0;
#endif
}

inline void SetFpMode(unsigned mode) {
#if defined(__x86_64__) || defined(__i386__)
  if (_mm_getcsr() != mode) _mm_setcsr(mode);
#else
  (void)mode;
#endif
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

thread_local bool t_in_job = false;  // a worker thread, or a caller inside Run

// Thread t's share of a job's chunks, [next, end) of [t * chunks / T, (t + 1) * chunks / T):
// it takes them in order, then takes what is left of the others' shares. A cache line each, so
// a thread claims its own chunks without moving a line between CPUs.
struct alignas(64) Share {
  std::atomic<int64_t> next{0};
  int64_t end = 0;

  bool Claim(int64_t* c) {
    if (next.load(std::memory_order_relaxed) >= end) return false;  // spent: no write
    *c = next.fetch_add(1);
    return *c < end;
  }
};

struct Job {
  void (*fn)(void*, int64_t);
  void* ctx;
  Share* shares;  // [threads], the pool's: they hold the job's chunks
  int64_t threads;
  int caller_cpu = -1;  // where the caller runs its chunks, if known
  unsigned fp_mode = FpMode();  // the caller's; a worker takes it for the job's chunks

  // Thread t's work: its own share, then the others' leftovers.
  void Work(int64_t t) {
    for (int64_t k = 0; k < threads; ++k) {
      Share& share = shares[(t + k) % threads];
      for (int64_t c; share.Claim(&c);) fn(ctx, c);
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

// Restricts thread `tid` (0: the calling thread) to `mask` but `cpu`.
void MoveOff(pid_t tid, const cpu_set_t& mask, int cpu) {
  cpu_set_t others = mask;
  CPU_CLR(cpu, &others);
  sched_setaffinity(tid, sizeof(others), &others);
}

// Where a worker waits: its thread id and the CPU it spins or yields on, or kNowhere (working,
// asleep, or moved off a caller's CPU since); `asleep` while on the condition variable.
constexpr int kNowhere = -1;
struct alignas(64) WorkerSlot {  // a cache line each: waiting workers write theirs
  std::atomic<pid_t> tid{0};
  std::atomic<int> cpu{kNowhere};
  std::atomic<bool> asleep{false};  // on the condition variable: it may wake on any CPU

  void Publish(int c) {
    if (cpu.load(std::memory_order_relaxed) != c) cpu.store(c, std::memory_order_relaxed);
  }
};

// Set in a child forked after the pool started: its workers did not survive the fork (and
// the slots name the parent's threads), so every job runs on its caller.
std::atomic<bool> g_forked{false};

class SpinPool {
 public:
  SpinPool()
      : threads_(AvailableThreads()),
        slots_(new WorkerSlot[threads_]),
        shares_(new Share[threads_]) {
    pthread_atfork(nullptr, nullptr, [] { g_forked.store(true); });
    CPU_ZERO(&mask_);  // unknown (no moves) if the call fails
    sched_getaffinity(0, sizeof(mask_), &mask_);
    cpus_ = CPU_COUNT(&mask_);
    for (int64_t t = 1; t < threads_; ++t) {
      std::thread([this, t] { WorkerLoop(slots_[t]); }).detach();
    }
  }

  int64_t threads() const { return threads_; }

  void Run(int64_t chunks, void (*fn)(void*, int64_t), void* ctx) {
    if (t_in_job || threads_ <= 1 || g_forked.load(std::memory_order_relaxed)) {  // run here
      RunHere(chunks, fn, ctx);
      return;
    }
    std::unique_lock<std::mutex> submit(submit_mu_, std::try_to_lock);
    if (!submit.owns_lock()) {  // another caller has the workers
      RunHere(chunks, fn, ctx);
      return;
    }
    for (int64_t t = 0; t < threads_; ++t) {  // no worker is inside a job (busy_ == 0)
      shares_[t].end = (t + 1) * chunks / threads_;
      shares_[t].next.store(t * chunks / threads_, std::memory_order_relaxed);
    }
    Job job{fn, ctx, shares_.get(), threads_};
    t_in_job = true;
    job.caller_cpu = MoveWorkersOffMyCpu();
    job_.store(&job);
    gen_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    job.Work(0);  // returns once every share is spent: every chunk claimed
    // A worker still in a chunk holds busy_ until the chunk is done.
    job_.store(nullptr);
    while (busy_.load() != 0) CpuRelax();
    t_in_job = false;
  }

 private:
  static void RunHere(int64_t chunks, void (*fn)(void*, int64_t), void* ctx) {
    for (int64_t c = 0; c < chunks; ++c) fn(ctx, c);
  }

  // Moves every worker waiting or sleeping on the caller's CPU onto the process's other CPUs;
  // returns the caller's CPU, or -1 where moving cannot help (one CPU, more threads than CPUs,
  // a caller outside the mask). Costs a getcpu and a read of each worker's slot.
  int MoveWorkersOffMyCpu() {
    const int me = sched_getcpu();
    if (me < 0 || !CPU_ISSET(me, &mask_) || cpus_ < 2 || threads_ > cpus_) return -1;
    for (int64_t t = 1; t < threads_; ++t) {
      if (slots_[t].cpu.load(std::memory_order_relaxed) != me && !slots_[t].asleep.load()) {
        continue;
      }
      const pid_t tid = slots_[t].tid.load();
      if (tid == 0) continue;  // not started (0 would name the caller itself)
      MoveOff(tid, mask_, me);
      slots_[t].cpu.store(kNowhere, std::memory_order_relaxed);
    }
    return me;
  }

  void WorkerLoop(WorkerSlot& slot) {
    t_in_job = true;
    pthread_setname_np(pthread_self(), "embark-pool");  // as top, perf and /proc show it
    slot.tid.store(static_cast<pid_t>(syscall(SYS_gettid)));
    uint64_t seen = gen_.load();
    for (;;) {
      seen = WaitForJob(seen, slot);
      slot.Publish(kNowhere);
      busy_.fetch_add(1);
      if (Job* job = job_.load()) {
        if (job->caller_cpu >= 0 && sched_getcpu() == job->caller_cpu) {  // woken onto it
          MoveOff(0, mask_, job->caller_cpu);
        }
        SetFpMode(job->fp_mode);
        job->Work(&slot - slots_.get());
      }
      busy_.fetch_sub(1);
    }
  }

  // Spins, then yields, then sleeps, until gen_ moves past `seen`; returns the new generation.
  // Yielding keeps the worker awake (waking a sleeping worker takes long enough that a kernel
  // called every few ms would run on its caller alone) while any other runnable thread, such
  // as XLA's own, gets the CPU, as libgomp's workers stay busy for a while after a region.
  uint64_t WaitForJob(uint64_t seen, WorkerSlot& slot) {
    const auto start = std::chrono::steady_clock::now();
    const bool spin = g_spin.load(std::memory_order_relaxed);
    slot.Publish(sched_getcpu());
    for (int i = 0; spin; ++i) {
      const uint64_t g = gen_.load();
      if (g != seen) return g;
      CpuRelax();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() - start > kSpin) break;
    }
    while (spin) {
      const uint64_t g = gen_.load();
      if (g != seen) return g;
      sched_yield();
      slot.Publish(sched_getcpu());
      if (std::chrono::steady_clock::now() - start > kYield) break;
    }
    slot.Publish(kNowhere);
    if (cpus_ > 0) {  // back to every CPU (it stays where it is)
      sched_setaffinity(0, sizeof(mask_), &mask_);
    }
    slot.asleep.store(true);  // moved off a caller's CPU wherever it sleeps
    sleepers_.fetch_add(1);
    std::unique_lock<std::mutex> lock(sleep_mu_);
    wake_.wait(lock, [&] { return gen_.load() != seen; });
    sleepers_.fetch_sub(1);
    slot.asleep.store(false);
    return gen_.load();
  }

  const int64_t threads_;
  const std::unique_ptr<WorkerSlot[]> slots_;  // [0] unused: the caller is thread 0
  const std::unique_ptr<Share[]> shares_;       // the current job's, [t]: thread t's
  cpu_set_t mask_;                              // the CPUs this process may run on
  int cpus_ = 0;                                // how many: CPU_COUNT(&mask_)
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

void SetCpuSpin(bool on) { g_spin.store(on); }
bool GetCpuSpin() { return g_spin.load(); }

void CpuPoolRun(int64_t chunks, void (*fn)(void*, int64_t), void* ctx) {
  Pool().Run(chunks, fn, ctx);
}

}  // namespace embark
