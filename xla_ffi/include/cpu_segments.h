// Segment-id helpers shared by the CPU kernels that pool sorted segments (lookup_pool,
// segment_sum): the order check and the first position of a segment.
#pragma once

#include <algorithm>
#include <cstdint>

namespace embark {

// True if seg[max(p0, 1) - 1 .. p1) is ascending.
template <typename S>
bool AscendingRange(const S* seg, int64_t p0, int64_t p1) {
  bool ok = true;
  for (int64_t i = p0 > 1 ? p0 : 1; i < p1; ++i) ok &= seg[i - 1] <= seg[i];
  return ok;
}

// The first position of seg[0, n) (ascending) whose segment is >= value.
template <typename S>
int64_t LowerBound(const S* seg, int64_t n, int64_t value) {
  return std::lower_bound(seg, seg + n, value,
                          [](S a, int64_t v) { return static_cast<int64_t>(a) < v; }) -
         seg;
}

}  // namespace embark
