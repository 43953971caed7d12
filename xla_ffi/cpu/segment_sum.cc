// segment_sum on the CPU: out[s, :] = sum of values[i, :] over i with segment_ids[i] == s.
// Segment ids outside [0, num_segments) are dropped (padding uses -1). Each worker owns a
// range of output segments and scans all ids, so no two threads write the same row and the
// ids need not be sorted.
#include <vector>

#include "embark_ffi.h"
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
                          ffi::Result<ffi::AnyBuffer> out) {
  auto vdims = values.dimensions();
  auto odims = out->dimensions();
  if (vdims.size() != 2 || odims.size() != 2) {
    return InvalidArgument("segment_sum expects values [N, D] and output [S, D]");
  }
  int64_t n = vdims[0], d = vdims[1], s = odims[0];
  if (static_cast<int64_t>(segment_ids.element_count()) != n || odims[1] != d) {
    return InvalidArgument("segment_sum: segment_ids must be [N] and output [S, D]");
  }
  if (!IsIdType(segment_ids.element_type())) {
    return InvalidArgument("segment_sum: segment_ids must be int32 or int64");
  }
  switch (values.element_type()) {
    case ffi::DataType::F32:
      SegmentSumTyped(pool, static_cast<const float*>(values.untyped_data()), segment_ids, n, d, s,
                      static_cast<float*>(out->untyped_data()));
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      SegmentSumTyped(pool, static_cast<const uint16_t*>(values.untyped_data()), segment_ids, n,
                      d, s, static_cast<uint16_t*>(out->untyped_data()));
      return ffi::Error::Success();
    default:
      return InvalidArgument("segment_sum: values must be float32 or bfloat16");
  }
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSegmentSumCpu, embark::SegmentSumImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
