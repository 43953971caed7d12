// Segment-id helpers shared by the CPU kernels that pool sorted segments (lookup_pool,
// segment_sum): the order check and the first position of a segment.
#pragma once

#include <algorithm>
#include <cstdint>

namespace embark {

// True if seg[max(p0, 1) - 1 .. p1) is ascending. Written as an OR of descents into an
// integer so that the compiler vectorises it (the `bool ok &= a <= b` form was not: 8192
// int32 ids took 2.3 us, a tenth of a 1024 x 8 x 64 lookup on one thread; this form 0.7 us).
template <typename S>
bool AscendingRange(const S* seg, int64_t p0, int64_t p1) {
  unsigned descents = 0;
  for (int64_t i = p0 > 1 ? p0 : 1; i < p1; ++i) {
    descents |= static_cast<unsigned>(seg[i] < seg[i - 1]);
  }
  return descents == 0;
}

// The first position of seg[0, n) (ascending) whose segment is >= value.
template <typename S>
int64_t LowerBound(const S* seg, int64_t n, int64_t value) {
  return std::lower_bound(seg, seg + n, value,
                          [](S a, int64_t v) { return static_cast<int64_t>(a) < v; }) -
         seg;
}

}  // namespace embark
