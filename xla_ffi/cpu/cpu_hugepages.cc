// Huge pages for randomly read tables (cpu_hugepages.h has the why and the modes).
#include "cpu_hugepages.h"

#include "cpu_malloc.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older headers lack the name
#endif

namespace embark {
namespace {

constexpr int64_t kSlice = int64_t{32} << 20;  // one MADV_COLLAPSE call: stops early if freed
constexpr size_t kRegistry = 4096;             // tables remembered (address, size), LRU
using Clock = std::chrono::steady_clock;
// A table seen again is advised again after this long (then twice as long each time the
// advice found 4 KiB pages to move: a buffer replaced at the same address by every step).
constexpr auto kRecheck = std::chrono::seconds(1);
constexpr auto kMaxRecheck = std::chrono::seconds(64);
// Advice that takes longer than this moved pages (a range already on huge pages is re-advised
// well within it), so the table's backoff doubles.
constexpr auto kMovedSomething = std::chrono::milliseconds(5);
// A range not seen for this long is taken for a new table when it comes back (a table freed
// and its successor allocated at the same address, as one of the same size usually is):
// advised after its second call, whatever the backoff of the old one; otherwise a table
// built after one of the same size was freed would run its first seconds on 4 KiB pages.
constexpr auto kForget = std::chrono::seconds(1);

// EMBARK_HUGEPAGES is read by embark_jax.ops.native, which sets the mode before any kernel runs.
std::atomic<int> g_mode{static_cast<int>(HugePageMode::AUTO)};

struct Range {
  uintptr_t addr = 0;
  int64_t bytes = 0;
  bool operator==(const Range& o) const { return addr == o.addr && bytes == o.bytes; }
};

// The tables seen lately and the background thread's queue; one mutex guards both. XLA may
// free a table and allocate its successor at the same address (a step without donation), on
// 4 KiB pages again, so a table is not advised once for all: seen again after `interval`, it
// is queued again (cheap for a range already on huge pages); seen again after a pause of
// kForget, it is advised as a new table.
class Advisor {
 public:
  void Note(const void* p, int64_t bytes) {
    const Range r{reinterpret_cast<uintptr_t>(p), bytes};
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seen_.find(r);
    const bool idle =
        it != seen_.end() && !it->second.queued && now - it->second.last_seen > kForget;
    if (it == seen_.end() || idle) {  // a new table (idle: perhaps at an old one's address)
      if (it == seen_.end() && seen_.size() >= kRegistry) EvictOldest();
      seen_.insert_or_assign(r, Entry{1, false, false, now, now, kRecheck});
      return;
    }
    Entry& e = it->second;
    e.last_seen = now;
    if (!e.queued && ++e.calls >= 2 && now >= e.due) Enqueue(r, e);
  }

  HugePageStats Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  bool Wait(double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    return idle_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                          [&] { return queue_.empty() && !working_; });
  }

 private:
  struct Entry {
    int calls = 0;
    bool queued = false, advised = false;
    Clock::time_point due;                 // not queued again before
    Clock::time_point last_seen;
    Clock::duration interval = kRecheck;  // the wait after the next advice
  };
  struct RangeHash {
    size_t operator()(const Range& r) const {
      return std::hash<uintptr_t>()(r.addr) ^ (std::hash<int64_t>()(r.bytes) * 31);
    }
  };

  void EvictOldest() {  // mu_ held; rare: only with kRegistry tables in use
    auto oldest = seen_.end();
    for (auto it = seen_.begin(); it != seen_.end(); ++it) {
      if (!it->second.queued && (oldest == seen_.end() ||
                                 it->second.last_seen < oldest->second.last_seen)) {
        oldest = it;
      }
    }
    if (oldest != seen_.end()) seen_.erase(oldest);
  }

  void Enqueue(const Range& r, Entry& e) {  // mu_ held
    e.queued = true;
    queue_.push_back(r);
    ++stats_.queued;
    if (!started_) {
      started_ = true;
      std::thread([this] { Loop(); }).detach();  // lives as long as the process
    }
    work_.notify_one();
  }

  void Drop(const Range& r) {  // mu_ held: not advised; seen again, it is queued again
    auto it = seen_.find(r);
    if (it != seen_.end()) it->second.queued = false;
  }

  void Done(const Range& r, int64_t got, Clock::duration took) {  // mu_ held
    auto it = seen_.find(r);
    if (it != seen_.end()) {
      Entry& e = it->second;
      e.queued = false;
      e.calls = 0;
      // Replaced since the last advice (it had pages to move again), or refused: back off.
      if ((e.advised && took > kMovedSomething) || got < 0) {
        e.interval = std::min<Clock::duration>(2 * e.interval, kMaxRecheck);
      }
      e.advised = true;
      e.due = Clock::now() + e.interval;
    }
    if (got < 0) {
      ++stats_.failed;
      stats_.last_error = -got;
    } else {
      ++stats_.advised;
      stats_.bytes += got;
    }
  }

  void Loop() {
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);  // below the kernels
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_.wait(lock, [&] { return !queue_.empty(); });
      const Range r = queue_.front();
      queue_.pop_front();
      working_ = true;
      lock.unlock();
      // Advice queued before the mode was turned off is dropped: its table may be gone and
      // its range reused by a buffer allocated since, which `off` promises to leave alone.
      const bool off = GetHugePageMode() == HugePageMode::OFF;
      const Clock::time_point t0 = Clock::now();
      const int64_t got =
          off ? 0 : AdviseHugePages(reinterpret_cast<const void*>(r.addr), r.bytes);
      const Clock::duration took = Clock::now() - t0;
      lock.lock();
      working_ = false;
      if (off) {
        Drop(r);
      } else {
        Done(r, got, took);
      }
      if (queue_.empty()) idle_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_, idle_;
  std::unordered_map<Range, Entry, RangeHash> seen_;
  std::deque<Range> queue_;
  bool started_ = false, working_ = false;
  HugePageStats stats_;
};

Advisor& TheAdvisor() {
  static Advisor* advisor = new Advisor();  // never destroyed: its thread outlives teardown
  return *advisor;
}

// The 2 MiB-aligned interior [lo, hi) of [p, p + bytes); empty (hi <= lo) if there is none.
void AlignedInterior(const void* p, int64_t bytes, uintptr_t* lo, uintptr_t* hi) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t mask = static_cast<uintptr_t>(kHugePageBytes - 1);
  *lo = (begin + mask) & ~mask;
  *hi = (begin + static_cast<uintptr_t>(bytes)) & ~mask;
}

}  // namespace

int64_t AdviseHugePages(const void* p, int64_t bytes) {
  if (bytes < kMinHugePageBytes) return 0;
  uintptr_t lo, hi;
  AlignedInterior(p, bytes, &lo, &hi);
  if (hi <= lo) return 0;
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE) != 0) return -errno;
  // Pages never written cannot be collapsed (EINVAL); the advice above gives them huge pages
  // when first written. A slice that fails is retried region by region below.
  int64_t moved = 0, error = 0;
  for (uintptr_t a = lo; a < hi; a += kSlice) {
    const uintptr_t len = hi - a < static_cast<uintptr_t>(kSlice) ? hi - a : kSlice;
    if (madvise(reinterpret_cast<void*>(a), len, MADV_COLLAPSE) == 0) {
      moved += static_cast<int64_t>(len);
      continue;
    }
    error = errno;
    if (error == ENOMEM) break;  // no longer mapped: the buffer was freed
    // Some 2 MiB region of the slice could not be collapsed (never written: EINVAL); the
    // others still can, one at a time.
    for (uintptr_t h = a; h < a + len; h += static_cast<uintptr_t>(kHugePageBytes)) {
      if (madvise(reinterpret_cast<void*>(h), kHugePageBytes, MADV_COLLAPSE) == 0) {
        moved += kHugePageBytes;
      }
    }
  }
  return moved > 0 || error == 0 ? moved : -error;
}

void NoteFreshOutput(void* p, int64_t bytes) {
  // Smaller outputs come from the heap, already faulted in: advising them would only split
  // its mapping and wake khugepaged (which a large one served from the heap may still do).
  if (bytes < kMallocMmapThreshold || GetHugePageMode() == HugePageMode::OFF) return;
  uintptr_t lo, hi;
  AlignedInterior(p, bytes, &lo, &hi);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
}

void NoteRandomAccess(const void* p, int64_t bytes) {
  if (bytes < kMinHugePageBytes || GetHugePageMode() == HugePageMode::OFF) return;
  TheAdvisor().Note(p, bytes);
}

HugePageMode GetHugePageMode() {
  return static_cast<HugePageMode>(g_mode.load(std::memory_order_relaxed));
}

void SetHugePageMode(HugePageMode mode) {
  g_mode.store(static_cast<int>(mode), std::memory_order_relaxed);
}

HugePageStats GetHugePageStats() { return TheAdvisor().Stats(); }

bool WaitHugePages(double timeout_s) { return TheAdvisor().Wait(timeout_s); }

}  // namespace embark
