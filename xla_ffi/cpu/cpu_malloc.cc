// glibc's allocator thresholds for the CPU kernels' outputs (cpu_malloc.h).
#include "cpu_malloc.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace embark {

int TuneHostMalloc() {
#if defined(__GLIBC__)
  // Setting either value turns off glibc's dynamic adjustment of both, so set both.
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMallocMmapThreshold)) != 1) return -1;
  if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(kMallocTrimThreshold)) != 1) return -1;
  return 1;
#else
  return 0;
#endif
}

}  // namespace embark
