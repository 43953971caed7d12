// Fused backward + optimizer on the CPU (FBGEMM's "fused backward"): dedup the looked-up
// ids, reduce each unique row's gradient in a worker-local buffer and apply the optimizer to
// that row at once. No [C, D] gradient buffer is written or read back; the table and slots
// are updated in place (outputs alias inputs). Every distinct row is applied: there is no
// capacity to overflow. num_unique returns how many rows were touched.
#include <vector>

#include "cpu_grad.h"
#include "cpu_optim.h"
#include "cpu_sort.h"
#include "embark_ffi.h"
#include "kernels.h"

namespace embark {
namespace {

template <typename T, typename G>
void Run(ffi::ThreadPool& pool, const SortedIds& s, const std::vector<int64_t>& starts,
         T* table, float* sa, float* sb, int64_t vocab, const G* grads, int64_t d,
         int64_t num_src, const ffi::AnyBuffer& seg, bool per_id, const float* scale,
         int64_t opt, const float* hp) {
  const int64_t u = static_cast<int64_t>(starts.size()) - 1;
  ParallelFor(pool, u, 64, [&, table, sa, sb, grads, d, scale, hp](int64_t k0, int64_t k1) {
    std::vector<float> acc(d);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t r = static_cast<int64_t>(s.keys[starts[k]]);
      if (r >= vocab) continue;
      if (k + 2 < k1) Prefetch(table + static_cast<int64_t>(s.keys[starts[k + 2]]) * d);
      AccumulateRun(s, starts, k, grads, d, num_src, seg, per_id, scale, acc.data());
      ApplyRow(opt, table, sa, sb, r, acc.data(), d, hp);
    }
  });
}

template <typename T>
void DispatchGrad(ffi::ThreadPool& pool, const SortedIds& s, const std::vector<int64_t>& starts,
                  T* table, float* sa, float* sb, int64_t vocab, const ffi::AnyBuffer& grads,
                  int64_t d, const ffi::AnyBuffer& seg, bool per_id, const float* scale,
                  int64_t opt, const float* hp) {
  const int64_t num_src = grads.dimensions()[0];
  if (grads.element_type() == ffi::DataType::F32) {
    Run(pool, s, starts, table, sa, sb, vocab, static_cast<const float*>(grads.untyped_data()), d,
        num_src, seg, per_id, scale, opt, hp);
  } else {
    Run(pool, s, starts, table, sa, sb, vocab, static_cast<const uint16_t*>(grads.untyped_data()),
        d, num_src, seg, per_id, scale, opt, hp);
  }
}

ffi::Error SparseGradUpdateImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::Buffer<ffi::F32> slot_a,
    ffi::Buffer<ffi::F32> slot_b, ffi::AnyBuffer grads, ffi::AnyBuffer ids, ffi::AnyBuffer seg,
    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> hparams,
    ffi::Result<ffi::AnyBuffer> table_out, ffi::Result<ffi::Buffer<ffi::F32>> slot_a_out,
    ffi::Result<ffi::Buffer<ffi::F32>> slot_b_out, ffi::Result<ffi::Buffer<ffi::S32>> num_unique,
    ffi::Result<ffi::AnyBuffer> /*workspace: CUDA only*/, int64_t optimizer, int64_t per_id) {
  auto td = table.dimensions();
  auto gd = grads.dimensions();
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (td.size() != 2 || gd.size() != 2 || gd[1] != td[1]) {
    return InvalidArgument("sparse_grad_update expects table [V, D] and grads [S, D]");
  }
  const int64_t vocab = td[0], d = td[1];
  if (!IsIdType(ids.element_type()) || static_cast<int64_t>(scale.element_count()) != n ||
      (!per_id && static_cast<int64_t>(seg.element_count()) != n)) {
    return InvalidArgument("sparse_grad_update: ids, segment_ids and scale must all be [N]");
  }
  if (!ValidOptimizer(optimizer)) return InvalidArgument("sparse_grad_update: bad optimizer");
  if (static_cast<int64_t>(slot_a.element_count()) < SlotAElements(optimizer, vocab, d) ||
      static_cast<int64_t>(slot_b.element_count()) < SlotBElements(optimizer, vocab, d)) {
    return InvalidArgument("sparse_grad_update: optimizer slots too small for the table");
  }
  if (!IsFloatType(grads.element_type())) {
    return InvalidArgument("sparse_grad_update: grads must be float32 or bfloat16");
  }
  CopyIfNotAliased(table_out->untyped_data(), table.untyped_data(), table.size_bytes());
  CopyIfNotAliased(slot_a_out->typed_data(), slot_a.typed_data(), slot_a.size_bytes());
  CopyIfNotAliased(slot_b_out->typed_data(), slot_b.typed_data(), slot_b.size_bytes());
  SortedIds s = SortValidIds(n, [&ids](int64_t i) { return LoadId(ids, i); });
  std::vector<int64_t> starts = RunStarts(s.keys);
  float* sa = slot_a_out->typed_data();
  float* sb = slot_b_out->typed_data();
  const float* hp = hparams.typed_data();
  if (table.element_type() == ffi::DataType::F32) {
    DispatchGrad(pool, s, starts, static_cast<float*>(table_out->untyped_data()), sa, sb, vocab,
                 grads, d, seg, per_id != 0, scale.typed_data(), optimizer, hp);
  } else if (table.element_type() == ffi::DataType::BF16) {
    DispatchGrad(pool, s, starts, static_cast<uint16_t*>(table_out->untyped_data()), sa, sb,
                 vocab, grads, d, seg, per_id != 0, scale.typed_data(), optimizer, hp);
  } else {
    return InvalidArgument("sparse_grad_update: table must be float32 or bfloat16");
  }
  num_unique->typed_data()[0] = static_cast<int32_t>(starts.size() - 1);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSparseGradUpdateCpu, embark::SparseGradUpdateImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()              // table [V, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // slot a
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // slot b
                                  .Arg<xla::ffi::AnyBuffer>()              // grads [S, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // ids [N]
                                  .Arg<xla::ffi::AnyBuffer>()              // segment_ids [N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale [N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // hparams [4]
                                  .Ret<xla::ffi::AnyBuffer>()              // table (aliased)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // slot a (aliased)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // slot b (aliased)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // num_unique []
                                  .Ret<xla::ffi::AnyBuffer>()              // workspace
                                  .Attr<int64_t>("optimizer")
                                  .Attr<int64_t>("per_id"));
