// segment_sum on the CPU: out[s, :] = sum of values[i, :] over i with segment_ids[i] == s.
// Segment ids outside [0, num_segments) are dropped (padding uses -1). Each worker owns a
// range of output segments and scans all ids, so no two threads write the same row and the
// ids need not be sorted.
#include <vector>

#include "embark_dispatch.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

template <typename T>
void SegmentSumTyped(ffi::ThreadPool& pool, const T* values, const ffi::AnyBuffer& seg,
                     int64_t n, int64_t d, int64_t num_segments, T* out) {
  ParallelFor(pool, num_segments, 256, [=, &seg](int64_t s0, int64_t s1) {
    std::vector<float> acc(static_cast<size_t>((s1 - s0) * d), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      int64_t s = LoadId(seg, i);
      if (s < s0 || s >= s1) continue;
      float* a = acc.data() + (s - s0) * d;
      const T* v = values + i * d;
      for (int64_t j = 0; j < d; ++j) a[j] += Elem<T>::Load(v, j);
    }
    for (int64_t k = 0; k < (s1 - s0) * d; ++k) Elem<T>::Store(out + s0 * d, k, acc[k]);
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
  return DispatchFloat<HostBf16>("segment_sum", "values", values.element_type(), [&](auto tag) {
    using T = EMBARK_TYPE(tag);
    SegmentSumTyped(pool, static_cast<const T*>(values.untyped_data()), segment_ids, n, d, s,
                    static_cast<T*>(out->untyped_data()));
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
