// The sparse gradient of a lookup on the CPU: dedup of the looked-up ids + segment reduction.
//
//   row_grads[k] = sum over i with ids[i] == unique_rows[k] of scale[i] * grads[src(i)]
//
// where src(i) = segment_ids[i] (pooled lookups: the bag's output gradient) or i (per_id=1:
// the `none` combiner, or merging duplicate rows of an update). unique_rows is sorted and
// padded with -1; slots past the capacity are dropped and num_unique tells how many there
// were. Workers own disjoint ranges of unique rows, so the reduction needs no atomics.
#include <vector>

#include "cpu_grad.h"
#include "cpu_hugepages.h"
#include "cpu_sort.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

template <typename G>
void Reduce(ffi::ThreadPool& pool, const SortedIds& s, const RawArray<int64_t>& starts,
            int64_t slots, const G* grads, int64_t d, int64_t num_src,
            const ffi::AnyBuffer& seg, bool per_id, const float* scale, float* out) {
  const OneGrad<G> one(grads, num_src);
  const GradRows<G> g = one.View(d);
  ParallelFor(pool, slots, 64, [&, d, scale, out](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      AccumulateRun(s, starts, k, g, d, seg, per_id, scale, out + k * d);
    }
  });
}

// Writes the first `slots` unique ids to unique_rows[0..cap), padded with -1.
template <typename I>
void WriteUniqueRows(const SortedIds& s, const RawArray<int64_t>& starts, int64_t slots,
                     int64_t cap, I* unique_rows) {
  for (int64_t k = 0; k < cap; ++k) {
    unique_rows[k] = static_cast<I>(k < slots ? static_cast<int64_t>(s.keys[starts[k]]) : -1);
  }
}

ffi::Error SparseGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer grads, ffi::AnyBuffer ids,
                          ffi::AnyBuffer seg, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> unique_rows,
                          ffi::Result<ffi::Buffer<ffi::F32>> row_grads,
                          ffi::Result<ffi::Buffer<ffi::S32>> num_unique,
                          ffi::Result<ffi::AnyBuffer> /*workspace: CUDA only*/, int64_t per_id) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int64_t cap = static_cast<int64_t>(unique_rows->element_count());
  ffi::Error err =
      CheckSparseGrad(grads, ids, seg, scale, *unique_rows, *row_grads, *num_unique,
                      per_id != 0);
  if (err.failure()) return err;
  const int64_t d = grads.dimensions()[1];
  SortedIds s = SortValidIds(n, [&ids](int64_t i) { return LoadId(ids, i); });
  RawArray<int64_t> starts = RunStarts(s.keys);
  const int64_t u = static_cast<int64_t>(starts.size()) - 1;
  const int64_t slots = u < cap ? u : cap;
  err = DispatchId("sparse_grad", "ids", ids.element_type(), [&](auto tag) {
    using I = EMBARK_TYPE(tag);
    WriteUniqueRows(s, starts, slots, cap, static_cast<I*>(unique_rows->untyped_data()));
  });
  if (err.failure()) return err;
  float* out = row_grads->typed_data();
  NoteFreshOutput(out, static_cast<int64_t>(row_grads->size_bytes()));
  for (int64_t k = slots * d; k < cap * d; ++k) out[k] = 0.0f;
  err = DispatchFloat<HostBf16>("sparse_grad", "grads", grads.element_type(), [&](auto tag) {
    using G = EMBARK_TYPE(tag);
    Reduce(pool, s, starts, slots, static_cast<const G*>(grads.untyped_data()), d,
           grads.dimensions()[0], seg, per_id != 0, scale.typed_data(), out);
  });
  if (err.failure()) return err;
  num_unique->typed_data()[0] = static_cast<int32_t>(u);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSparseGradCpu, embark::SparseGradImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()              // grads [S, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // ids [N]
                                  .Arg<xla::ffi::AnyBuffer>()              // segment_ids [N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale [N]
                                  .Ret<xla::ffi::AnyBuffer>()              // unique_rows [C]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // row_grads [C, D]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // num_unique []
                                  .Ret<xla::ffi::AnyBuffer>()              // workspace
                                  .Attr<int64_t>("per_id"));
