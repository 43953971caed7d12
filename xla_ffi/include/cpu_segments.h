// Segment-id helpers shared by the CPU kernels that pool sorted segments (lookup_pool,
// segment_sum): the order check and the first position of a segment.
#pragma once

#include <algorithm>
#include <cstdint>

namespace embark {

// True if seg[max(p0, 1) - 1 .. p1) is ascending. Written as an OR of descents into an
// integer so that the compiler vectorises it (it does not vectorise the `bool ok &= a <= b`
// form, whose scalar loop is a noticeable part of a small lookup).
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
