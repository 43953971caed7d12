// Transparent huge pages for the tables the CPU kernels read at random (cpu/cpu_hugepages.cc).
//
// A lookup touches rows spread over the whole table: with 4 KiB pages nearly every row costs
// a TLB miss and a page walk (two-level under a hypervisor), which can take more time than
// moving the row; on 2 MiB pages most of those walks go (docs/benchmarks.md). XLA allocates
// the tables with malloc, which on Linux leaves them on 4 KiB pages unless the process opted
// in (THP "madvise" mode, the common default), so the kernels advise them themselves:
//
//   auto (default, EMBARK_HUGEPAGES=auto): a kernel reports each table it reads at random
//     (NoteRandomAccess); the second time one (address, size) is seen, a background thread
//     advises it (MADV_HUGEPAGE) and moves its pages into huge pages (MADV_COLLAPSE, Linux
//     6.1+). The kernel never waits. XLA may free a table and put the next one (a step that
//     does not donate it) at the same address, so a table still in use is advised again each
//     second (cheap for a range already on huge pages); when that advice takes over 5 ms
//     (it found 4 KiB pages again) or is refused, the interval doubles (up to 64 s), which
//     bounds the copying such churn causes. A range not seen for a second is taken for a new
//     table when it comes back (one freed and its successor put at its address): advised
//     after its second call again, whatever the old one's interval. The 4096 tables seen
//     last are remembered.
//     Only the 2 MiB-aligned interior of a buffer of at least kMinHugePageBytes is touched;
//     the advice changes no data and is harmless if the buffer is freed meanwhile (the calls
//     fail on an unmapped range, or advise its new owner).
//   Outputs too: a kernel about to write a large output reports it (NoteFreshOutput), which is
//     advised at once (MADV_HUGEPAGE only, nothing moved). glibc serves an allocation over its
//     mmap threshold (32 MiB as cpu_malloc.h sets it) from a fresh mapping each time, which the
//     kernel's writes would fault in 4 KiB at a time; advised, its pages fault in 2 MiB at a
//     time (e.g. lookup_pool_backward's [C, D] gradient). glibc may still serve such a
//     request from its heap (a free block that fits); the advice then only splits the heap's
//     mapping and lets khugepaged collapse the range later.
//   off (EMBARK_HUGEPAGES=off): nothing is advised; advice still queued when the mode is set
//     is dropped (its table may be gone and its range reused by a newer buffer).
//
// AdviseHugePages does the same synchronously for one buffer (embark_jax.ops.native).
#pragma once

#include <cstdint>

namespace embark {

constexpr int64_t kHugePageBytes = int64_t{2} << 20;
constexpr int64_t kMinHugePageBytes = 4 * kHugePageBytes;

enum class HugePageMode : int { OFF = 0, AUTO = 1 };

// Advises the 2 MiB-aligned interior of [p, p + bytes) and collapses it into huge pages now.
// Returns the bytes advised (0 when the buffer is smaller than kMinHugePageBytes) or -errno of
// the first call that failed (e.g. -EINVAL where THP is off or the kernel lacks MADV_COLLAPSE).
int64_t AdviseHugePages(const void* p, int64_t bytes);

// Auto mode's hook, called by a kernel once per call for a table it reads at random.
void NoteRandomAccess(const void* p, int64_t bytes);

// The hook of a kernel about to write [p, p + bytes) as an output: advises the 2 MiB-aligned
// interior of one of at least kMallocMmapThreshold (usually a fresh mapping; MADV_HUGEPAGE,
// synchronous, one madvise), so that its pages fault in 2 MiB at a time; errors are ignored.
void NoteFreshOutput(void* p, int64_t bytes);

// The update kernels' hook: a table updated in place (output aliased to input, the buffer
// donated) is the same buffer step after step, so worth advising; a fresh copy is not.
inline void NoteUpdatedTable(const void* in, const void* out, int64_t bytes) {
  if (in == out) NoteRandomAccess(in, bytes);
}

HugePageMode GetHugePageMode();
void SetHugePageMode(HugePageMode mode);

struct HugePageStats {
  int64_t queued = 0;     // advice requests handed to the background thread
  int64_t advised = 0;    // of those, done without error
  int64_t failed = 0;     // of those, refused by the OS (the errno is in last_error)
  int64_t bytes = 0;      // bytes the successful ones covered (already huge ones included)
  int64_t last_error = 0;
};
HugePageStats GetHugePageStats();

// Waits until the background thread has handled every queued buffer, at most timeout_s
// seconds; returns whether it had.
bool WaitHugePages(double timeout_s);

}  // namespace embark
