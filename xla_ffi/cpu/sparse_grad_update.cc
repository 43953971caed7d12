// Fused backward + optimizer on the CPU (FBGEMM's "fused backward"): dedup the looked-up
// ids, reduce each unique row's gradient in a worker-local buffer and apply the optimizer to
// that row at once. No [C, D] gradient buffer is written or read back; the table and slots
// are updated in place (outputs alias inputs). Every distinct row is applied: there is no
// capacity to overflow. num_unique returns how many rows were touched. bfloat16 tables are
// rounded as in sparse_update (cpu_optim.h: to nearest, or stochastically per the hparams).
#include <vector>

#include "cpu_grad.h"
#include "cpu_optim.h"
#include "cpu_sort.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

// The dedup'd ids and the operands every worker reads.
struct Problem {
  const SortedIds* s;
  const RawArray<int64_t>* starts;
  int64_t vocab, d, num_src;
  const ffi::AnyBuffer* seg;
  bool per_id;
  const float* scale;
  Optimizer opt;
  abi::Hparams hp;
};

template <typename T, typename G>
void Run(ffi::ThreadPool& pool, const Problem& p, T* table, float* sa, float* sb,
         const G* grads) {
  const SortedIds& s = *p.s;
  const RawArray<int64_t>& starts = *p.starts;
  const int64_t u = static_cast<int64_t>(starts.size()) - 1;
  const int64_t d = p.d;
  const OneGrad<G> one(grads, p.num_src);
  const GradRows<G> g = one.View(d);
  ParallelFor(pool, u, 64, [&, table, sa, sb, d](int64_t k0, int64_t k1) {
    std::vector<float> acc(d);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t r = static_cast<int64_t>(s.keys[starts[k]]);
      if (r >= p.vocab) continue;
      if (k + 2 < k1) Prefetch(table + static_cast<int64_t>(s.keys[starts[k + 2]]) * d);
      AccumulateRun(s, starts, k, g, d, *p.seg, p.per_id, p.scale, acc.data());
      ApplyRow(p.opt, table, sa, sb, r, acc.data(), d, p.hp);
    }
  });
}

ffi::Error SparseGradUpdateImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::Buffer<ffi::F32> slot_a,
    ffi::Buffer<ffi::F32> slot_b, ffi::AnyBuffer grads, ffi::AnyBuffer ids, ffi::AnyBuffer seg,
    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> hparams,
    ffi::Result<ffi::AnyBuffer> table_out, ffi::Result<ffi::Buffer<ffi::F32>> slot_a_out,
    ffi::Result<ffi::Buffer<ffi::F32>> slot_b_out, ffi::Result<ffi::Buffer<ffi::S32>> num_unique,
    ffi::Result<ffi::AnyBuffer> /*workspace: CUDA only*/, int64_t optimizer, int64_t per_id) {
  ffi::Error err = CheckSparseGradUpdate(table, slot_a, slot_b, grads, ids, seg, scale, hparams,
                                         optimizer, per_id != 0, *table_out, *slot_a_out,
                                         *slot_b_out, *num_unique);
  if (err.failure()) return err;
  StartTableAndSlots(table, slot_a, slot_b, *table_out, *slot_a_out, *slot_b_out);
  const int64_t n = static_cast<int64_t>(ids.element_count());
  SortedIds s = SortValidIds(n, [&ids](int64_t i) { return LoadId(ids, i); });
  RawArray<int64_t> starts = RunStarts(s.keys);
  const Problem p{&s, &starts, table.dimensions()[0], table.dimensions()[1],
                  grads.dimensions()[0], &seg, per_id != 0, scale.typed_data(),
                  static_cast<Optimizer>(optimizer), abi::LoadHparams(hparams.typed_data())};
  float* sa = slot_a_out->typed_data();
  float* sb = slot_b_out->typed_data();
  const char* kernel = "sparse_grad_update";
  err = DispatchFloat<HostBf16>(kernel, "table", table.element_type(), [&](auto t) {
    return DispatchFloat<HostBf16>(kernel, "grads", grads.element_type(), [&](auto g) {
      Run(pool, p, static_cast<EMBARK_TYPE(t)*>(table_out->untyped_data()), sa, sb,
          static_cast<const EMBARK_TYPE(g)*>(grads.untyped_data()));
    });
  });
  if (err.failure()) return err;
  num_unique->typed_data()[0] = static_cast<int32_t>(starts.size() - 1);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSparseGradUpdateCpu, embark::SparseGradUpdateImpl,
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()
                                  EMBARK_SPARSE_GRAD_UPDATE_OPERANDS);
