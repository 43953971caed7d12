// Fused gather + weighted pooling on the CPU.
//
//   pooled (sum/mean/sqrtn): out[s] = (sum_i w_i * table[ids_i] over i in segment s) / denom_s
//   none:                    out[i] = w_i * table[ids_i]
//
// Padding ids (< 0 or >= V) and segment ids outside [0, S) contribute nothing; empty bags are
// zero. Segment ids sorted ascending (the SparseFeatures layout) take the fast path: each
// worker pools a contiguous range of segments and prefetches rows ahead. Unsorted segment ids
// fall back to workers that own a segment range and scan all ids.
#include <algorithm>
#include <cmath>
#include <vector>

#include "embark_abi.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

using abi::Combiner;
constexpr int64_t kPrefetchDistance = 8;

template <typename T, typename O>
struct Pool {
  const T* table;
  int64_t vocab, d;
  const ffi::AnyBuffer* ids;
  const ffi::AnyBuffer* seg;
  const float* w;
  O* out;
  Combiner combiner;

  inline int64_t Id(int64_t i) const {
    int64_t x = LoadId(*ids, i);
    return (x >= 0 && x < vocab) ? x : -1;
  }

  inline void Accumulate(float* acc, int64_t id, float wi) const {
    const T* row = table + id * d;
    for (int64_t j = 0; j < d; ++j) acc[j] += wi * Elem<T>::Load(row, j);
  }

  inline void Emit(float* acc, int64_t s, float denom) const {
    float scale = 1.0f;
    if (combiner == Combiner::MEAN) scale = denom > 0 ? 1.0f / denom : 0.0f;
    if (combiner == Combiner::SQRTN) scale = denom > 0 ? 1.0f / std::sqrt(denom) : 0.0f;
    O* o = out + s * d;
    for (int64_t j = 0; j < d; ++j) Elem<O>::Store(o, j, acc[j] * scale);
  }

  inline float DenomTerm(float wi) const { return combiner == Combiner::SQRTN ? wi * wi : wi; }

  // Segments [s0, s1) whose ids occupy positions [lo, hi) in sorted order.
  void Sorted(int64_t s0, int64_t s1, int64_t lo, int64_t hi) const {
    std::vector<float> acc(d);
    int64_t i = lo;
    for (int64_t s = s0; s < s1; ++s) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      float denom = 0.0f;
      for (; i < hi && LoadId(*seg, i) == s; ++i) {
        if (i + kPrefetchDistance < hi) {
          int64_t nx = Id(i + kPrefetchDistance);
          if (nx >= 0) Prefetch(table + nx * d);
        }
        int64_t id = Id(i);
        if (id < 0) continue;
        Accumulate(acc.data(), id, w[i]);
        denom += DenomTerm(w[i]);
      }
      Emit(acc.data(), s, denom);
    }
  }

  void Unsorted(int64_t s0, int64_t s1, int64_t n) const {
    std::vector<float> acc((s1 - s0) * d, 0.0f);
    std::vector<float> denom(s1 - s0, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      int64_t s = LoadId(*seg, i);
      if (s < s0 || s >= s1) continue;
      int64_t id = Id(i);
      if (id < 0) continue;
      Accumulate(acc.data() + (s - s0) * d, id, w[i]);
      denom[s - s0] += DenomTerm(w[i]);
    }
    for (int64_t s = s0; s < s1; ++s) Emit(acc.data() + (s - s0) * d, s, denom[s - s0]);
  }

  void Rows(int64_t i0, int64_t i1) const {
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kPrefetchDistance < i1) {
        int64_t nx = Id(i + kPrefetchDistance);
        if (nx >= 0) Prefetch(table + nx * d);
      }
      int64_t id = Id(i);
      O* o = out + i * d;
      if (id < 0) {
        for (int64_t j = 0; j < d; ++j) Elem<O>::Store(o, j, 0.0f);
        continue;
      }
      const T* row = table + id * d;
      for (int64_t j = 0; j < d; ++j) Elem<O>::Store(o, j, w[i] * Elem<T>::Load(row, j));
    }
  }
};

int64_t LowerBound(const ffi::AnyBuffer& seg, int64_t n, int64_t value) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    if (LoadId(seg, mid) < value) lo = mid + 1; else hi = mid;
  }
  return lo;
}

template <typename T, typename O>
void Run(ffi::ThreadPool& pool, const Pool<T, O>& p, int64_t n, int64_t num_out) {
  if (p.combiner == Combiner::NONE) {
    ParallelFor(pool, n, 512, [&p](int64_t a, int64_t b) { p.Rows(a, b); });
    return;
  }
  bool sorted = true;
  for (int64_t i = 1; i < n && sorted; ++i) sorted = LoadId(*p.seg, i - 1) <= LoadId(*p.seg, i);
  if (sorted) {
    ParallelFor(pool, num_out, 64, [&p, n](int64_t s0, int64_t s1) {
      p.Sorted(s0, s1, LowerBound(*p.seg, n, s0), LowerBound(*p.seg, n, s1));
    });
  } else {
    ParallelFor(pool, num_out, 256, [&p, n](int64_t s0, int64_t s1) { p.Unsorted(s0, s1, n); });
  }
}

ffi::Error LookupPoolImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::AnyBuffer ids,
                          ffi::AnyBuffer seg, ffi::AnyBuffer weights,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                          int64_t combiner, int64_t indices_are_sorted) {
  // The workspace is the CUDA kernel's (same target signature); the CPU needs none.
  // indices_are_sorted is only a hint here: sortedness is checked in O(N) anyway.
  (void)workspace;
  (void)indices_are_sorted;
  const int64_t n = static_cast<int64_t>(ids.element_count());
  ffi::Error err = CheckLookupPool(table, ids, seg, weights, *out, combiner);
  if (err.failure()) return err;
  const int64_t vocab = table.dimensions()[0], d = table.dimensions()[1];
  return DispatchFloat<HostBf16>("lookup_pool", "table", table.element_type(), [&](auto t) {
    return DispatchFloat<HostBf16>("lookup_pool", "output", out->element_type(), [&](auto o) {
      using T = EMBARK_TYPE(t);
      using O = EMBARK_TYPE(o);
      Pool<T, O> p{static_cast<const T*>(table.untyped_data()), vocab, d, &ids, &seg,
                   static_cast<const float*>(weights.untyped_data()),
                   static_cast<O*>(out->untyped_data()), static_cast<Combiner>(combiner)};
      Run(pool, p, n, out->dimensions()[0]);
    });
  });
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkLookupPoolCpu, embark::LookupPoolImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // table [V, D]
                                  .Arg<xla::ffi::AnyBuffer>()  // ids [N]
                                  .Arg<xla::ffi::AnyBuffer>()  // segment_ids [N]
                                  .Arg<xla::ffi::AnyBuffer>()  // weights [N] f32
                                  .Ret<xla::ffi::AnyBuffer>()  // [S, D] or [N, D]
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace (CUDA only)
                                  .Attr<int64_t>("combiner")
                                  .Attr<int64_t>("indices_are_sorted"));
