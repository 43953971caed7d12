// Segment reduction of a lookup's gradient per unique row on the CPU, shared by sparse_grad
// and the fused backward + update kernel.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_sort.h"
#include "embark_ffi.h"

namespace embark {

// out[0..d) = sum over the k-th run of sorted ids of scale[i] * grads[src(i)], with
// src(i) = i when per_id, else segment_ids[i]; sources outside [0, num_src) are skipped.
// Inlined into its callers so that their per-instruction-set copies vectorise it.
template <typename G>
inline __attribute__((always_inline)) void AccumulateRun(const SortedIds& s, const std::vector<int64_t>& starts, int64_t k,
                          const G* grads, int64_t d, int64_t num_src, const ffi::AnyBuffer& seg,
                          bool per_id, const float* scale, float* out) {
  for (int64_t j = 0; j < d; ++j) out[j] = 0.0f;
  const int64_t end = starts[k + 1];
  for (int64_t t = starts[k]; t < end; ++t) {
    const int64_t i = s.positions[t];
    const int64_t src = per_id ? i : LoadId(seg, i);
    if (src < 0 || src >= num_src) continue;
    if (t + 4 < end) {
      const int64_t nx = per_id ? s.positions[t + 4] : LoadId(seg, s.positions[t + 4]);
      if (nx >= 0 && nx < num_src) Prefetch(grads + nx * d);
    }
    const G* __restrict g = grads + src * d;
    float* __restrict o = out;
    const float c = scale[i];
    for (int64_t j = 0; j < d; ++j) o[j] += c * Elem<G>::Load(g, j);
  }
}

}  // namespace embark
