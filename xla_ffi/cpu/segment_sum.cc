// segment_sum on the CPU: out[s, :] = sum of values[i, :] over i with segment_ids[i] == s.
// Segment ids outside [0, num_segments) are dropped (padding uses -1). Sorted segment ids
// (checked, O(N)) take the fast path: each worker sums the contiguous rows of a range of
// segments with SIMD register accumulators (segment_body.inc, compiled per instruction set
// and chosen at run time like lookup_pool's). Otherwise each worker owns a range of output
// segments and scans all ids, so no two threads write the same row.
#include <type_traits>
#include <vector>

#include "cpu_hugepages.h"
#include "cpu_isa.h"
#include "cpu_segments.h"
#include "cpu_simd.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {

namespace segment_scalar {
using Vec = ScalarVec;
#include "segment_body.inc"
}  // namespace segment_scalar

#if EMBARK_HAVE_X86_SIMD
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace segment_avx2 {
using Vec = Avx2Vec;
#include "segment_body.inc"
}  // namespace segment_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace segment_avx512 {
using Vec = Avx512Vec;
#include "segment_body.inc"
}  // namespace segment_avx512
#pragma GCC pop_options
#endif

namespace {

template <typename T, typename S>
using SumSortedFn = void (*)(const T*, int64_t, const S*, T*, int64_t, int64_t, int64_t,
                             int64_t);

template <typename T, typename S>
SumSortedFn<T, S> SelectSum(CpuIsa isa) {
#if EMBARK_HAVE_X86_SIMD
  if (isa >= CpuIsa::AVX512) return &segment_avx512::SumSorted<T, S>;  // AVX512_BF16 too
  if (isa == CpuIsa::AVX2) return &segment_avx2::SumSorted<T, S>;
#endif
  (void)isa;
  return &segment_scalar::SumSorted<T, S>;
}

template <typename T, typename S>
void SumUnsorted(const T* values, int64_t d, const S* seg, int64_t n, T* out, int64_t s0,
                 int64_t s1) {
  std::vector<float> acc(static_cast<size_t>((s1 - s0) * d), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = static_cast<int64_t>(seg[i]);
    if (s < s0 || s >= s1) continue;
    float* a = acc.data() + (s - s0) * d;
    const T* v = values + i * d;
    for (int64_t j = 0; j < d; ++j) a[j] += Elem<T>::Load(v, j);
  }
  for (int64_t k = 0; k < (s1 - s0) * d; ++k) Elem<T>::Store(out + s0 * d, k, acc[k]);
}

template <typename T, typename S>
void SegmentSumTyped(ffi::ThreadPool& pool, const T* values, const S* seg, int64_t n, int64_t d,
                     int64_t num_segments, T* out) {
  if (AscendingRange(seg, 0, n)) {
    const SumSortedFn<T, S> sum = SelectSum<T, S>(ActiveCpuIsa());
    ParallelFor(pool, num_segments, 32, [&](int64_t s0, int64_t s1) {
      sum(values, d, seg, out, s0, s1, LowerBound(seg, n, s0), LowerBound(seg, n, s1));
    });
    return;
  }
  ParallelFor(pool, num_segments, 256, [&](int64_t s0, int64_t s1) {
    SumUnsorted(values, d, seg, n, out, s0, s1);
  });
}

ffi::Error SegmentSumImpl(ffi::ThreadPool pool, ffi::AnyBuffer values, ffi::AnyBuffer segment_ids,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  // The workspace is the CUDA kernel's (same target signature); the CPU needs none.
  (void)workspace;
  ffi::Error err = CheckSegmentSum(values, segment_ids, *out);
  if (err.failure()) return err;
  const int64_t n = values.dimensions()[0], d = values.dimensions()[1];
  const int64_t s = out->dimensions()[0];
  NoteFreshOutput(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
  return DispatchFloat<HostBf16>("segment_sum", "values", values.element_type(), [&](auto tag) {
    return DispatchId("segment_sum", "segment_ids", segment_ids.element_type(), [&](auto sg) {
      using T = EMBARK_TYPE(tag);
      using S = EMBARK_TYPE(sg);
      SegmentSumTyped(pool, static_cast<const T*>(values.untyped_data()),
                      static_cast<const S*>(segment_ids.untyped_data()), n, d, s,
                      static_cast<T*>(out->untyped_data()));
    });
  });
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSegmentSumCpu, embark::SegmentSumImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());  // workspace (CUDA only)
