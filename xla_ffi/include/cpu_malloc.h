// The C library allocator's thresholds, as the CPU kernels' outputs need them
// (cpu/cpu_malloc.cc; policy and switch in embark_jax/ops/native.py, docs/design.md §7).
//
// XLA allocates each call's output with malloc and frees it when the array is dropped. glibc
// returns the top of its heap to the OS once more than M_TRIM_THRESHOLD bytes are free there,
// and serves requests of M_MMAP_THRESHOLD bytes or more from fresh mappings; both thresholds
// start low (128 KiB) and only rise as large blocks come and go. Until they have risen, a
// multi-MiB output lands on pages the kernel has to fault in and zero again at every call,
// which can dominate a lookup's time (docs/benchmarks.md). TuneHostMalloc sets the values
// glibc's own rule converges to (the mmap threshold at its 64-bit maximum, 32 MiB; the trim
// threshold at twice that) from the start.
#pragma once

#include <cstdint>

namespace embark {

constexpr int64_t kMallocMmapThreshold = int64_t{32} << 20;
constexpr int64_t kMallocTrimThreshold = 2 * kMallocMmapThreshold;

// 1: both thresholds set; 0: not glibc (nothing done); -1: glibc refused a value.
int TuneHostMalloc();

}  // namespace embark
