// The fused backward + optimizer of sparse_grad_update, undoable: dedup the looked-up ids,
// reduce each unique row's gradient, save the row's current weights and slots to staging
// rows, update the row in place, and say whether every updated value is finite. commit_rows
// then writes the saved rows back (an undo), or nothing: a training step decides on device,
// after this call, whether to keep the update (the updated rows, the loss and the dense
// update all finite, no refused overflow). Each touched row is read and written once, where
// it lies; a kept step writes nothing more.
//
// The output gradient comes in one or more pieces, rows one after the other (GradRows): the
// DP cluster passes each feature's gradient as it is, with no concatenated copy.
//
// Staged row k holds the k-th smallest distinct id inside the table; rows past the distinct
// count are -1 (the caller sizes them min(N, V), as many as there can be distinct rows).
// bfloat16 values are rounded exactly as the in-place kernels round them (cpu_optim.h), so
// the updated table is the one sparse_grad_update would have written.
#include <atomic>
#include <cstring>
#include <vector>

#include "cpu_grad.h"
#include "cpu_hugepages.h"
#include "cpu_isa.h"
#include "cpu_optim.h"
#include "cpu_simd.h"
#include "cpu_sort.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

// Where the previous rows go, and the dedup'd ids and operands every worker reads.
struct Stage {
  const SortedIds* s;
  const RawArray<int64_t>* starts;
  int64_t vocab, d, wa, wb;
  const ffi::AnyBuffer* seg;
  bool per_id;
  const float* scale;
  Optimizer opt;
  abi::Hparams hp;
  float* sa;  // the table's slots (updated in place)
  float* sb;
  float* old_a;  // the previous slot rows [C, wa], [C, wb]
  float* old_b;
};

// How many runs ahead the per-row loop prefetches table and slot rows.
constexpr int64_t kAhead = 4;

// The per-row loop, once per instruction set (stage_body.inc); floating-point contraction
// stays off so that every copy rounds exactly as the portable one.
namespace stage_scalar {
#include "stage_body.inc"
}  // namespace stage_scalar

#if EMBARK_HAVE_X86_SIMD
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#pragma GCC optimize("fp-contract=off")
namespace stage_avx2 {
#include "stage_body.inc"
}  // namespace stage_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx2,fma")
#pragma GCC optimize("fp-contract=off")
namespace stage_avx512 {
#include "stage_body.inc"
}  // namespace stage_avx512
#pragma GCC pop_options
#endif

template <typename T, typename G, typename R>
bool Run(ffi::ThreadPool& pool, const Stage& p, T* table, const GradRows<G>& grads, T* values,
         R* out_rows) {
#if EMBARK_HAVE_X86_SIMD
  const CpuIsa isa = ActiveCpuIsa();
  if (isa >= CpuIsa::AVX512) return stage_avx512::Run(pool, p, table, grads, values, out_rows);
  if (isa == CpuIsa::AVX2) return stage_avx2::Run(pool, p, table, grads, values, out_rows);
#endif
  return stage_scalar::Run(pool, p, table, grads, values, out_rows);
}

// The pieces' base pointers and first rows (`GradRows`), each piece in the first's dtype.
struct Pieces {
  std::vector<const void*> base;
  std::vector<int64_t> start{0};
  explicit Pieces(const std::vector<ffi::AnyBuffer>& pieces) {
    for (const ffi::AnyBuffer& g : pieces) {
      base.push_back(g.untyped_data());
      start.push_back(start.back() + g.dimensions()[0]);
    }
  }
  template <typename G>
  GradRows<G> View(int64_t d) const {
    const int64_t n = static_cast<int64_t>(base.size());
    return GradRows<G>{reinterpret_cast<const G* const*>(base.data()), start.data(), n, d,
                       UniformPieceRows(start.data(), n)};
  }
};

ffi::Error SparseGradStageImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::Buffer<ffi::F32> slot_a,
    ffi::Buffer<ffi::F32> slot_b, ffi::AnyBuffer ids, ffi::AnyBuffer seg,
    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> hparams,
    ffi::AnyBuffer /*staging values: aliased, never read*/, ffi::AnyBuffer /*staging a*/,
    ffi::AnyBuffer /*staging b*/, ffi::RemainingArgs grads,
    ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> values,
    ffi::Result<ffi::Buffer<ffi::F32>> staged_a, ffi::Result<ffi::Buffer<ffi::F32>> staged_b,
    ffi::Result<ffi::Buffer<ffi::S32>> num_unique, ffi::Result<ffi::Buffer<ffi::S32>> finite,
    ffi::Result<ffi::AnyBuffer> /*workspace: CUDA*/, ffi::Result<ffi::AnyBuffer> table_out,
    ffi::Result<ffi::Buffer<ffi::F32>> slot_a_out, ffi::Result<ffi::Buffer<ffi::F32>> slot_b_out,
    int64_t optimizer, int64_t per_id) {
  std::vector<ffi::AnyBuffer> pieces;
  ffi::Error err = CheckSparseGradStage(table, slot_a, slot_b, ids, seg, scale, hparams, grads,
                                        optimizer, per_id != 0, *rows, *values, *staged_a,
                                        *staged_b, *num_unique, *finite, *table_out, *slot_a_out,
                                        *slot_b_out, &pieces);
  if (err.failure()) return err;
  StartTableAndSlots(table, slot_a, slot_b, *table_out, *slot_a_out, *slot_b_out);
  const Pieces g_pieces(pieces);
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const TableRows block = RowsOf(table);
  const int64_t d = block.d;
  const int64_t cap = static_cast<int64_t>(rows->element_count());
  NoteFreshOutput(values->untyped_data(), static_cast<int64_t>(values->size_bytes()));
  SortedIds s = SortValidIds(n, [&ids](int64_t i) { return LoadId(ids, i); });
  RawArray<int64_t> starts = RunStarts(s.keys);
  // Runs of ids past the table sort last; dropping them leaves at most min(N, V) <= C runs.
  while (starts.size() > 1 &&
         static_cast<int64_t>(s.keys[starts[starts.size() - 2]]) >= block.vocab) {
    starts.truncate(starts.size() - 1);
  }
  const int64_t u = static_cast<int64_t>(starts.size()) - 1;
  const Stage p{&s, &starts, block.vocab, d, abi::SlotRowWidth(optimizer, 0, d),
                abi::SlotRowWidth(optimizer, 1, d), &seg, per_id != 0, scale.typed_data(),
                static_cast<Optimizer>(optimizer), abi::LoadHparams(hparams.typed_data()),
                slot_a_out->typed_data(), slot_b_out->typed_data(), staged_a->typed_data(),
                staged_b->typed_data()};
  bool ok = true;
  const char* kernel = "sparse_grad_stage";
  err = DispatchFloat<HostBf16>(kernel, "table", table.element_type(), [&](auto t) {
    return DispatchFloat<HostBf16>(kernel, "grads", pieces[0].element_type(), [&](auto g) {
      using T = EMBARK_TYPE(t);
      using G = EMBARK_TYPE(g);
      T* tab = static_cast<T*>(table_out->untyped_data());
      const GradRows<G> grd = g_pieces.View<G>(d);
      T* val = static_cast<T*>(values->untyped_data());
      if (rows->element_type() == ffi::DataType::S64) {
        int64_t* out = static_cast<int64_t*>(rows->untyped_data());
        ok = Run(pool, p, tab, grd, val, out);
        for (int64_t k = u; k < cap; ++k) out[k] = -1;
      } else {
        int32_t* out = static_cast<int32_t*>(rows->untyped_data());
        ok = Run(pool, p, tab, grd, val, out);
        for (int64_t k = u; k < cap; ++k) out[k] = -1;
      }
    });
  });
  if (err.failure()) return err;
  num_unique->typed_data()[0] = static_cast<int32_t>(u);
  finite->typed_data()[0] = ok ? 1 : 0;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSparseGradStageCpu, embark::SparseGradStageImpl,
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()
                                  EMBARK_SPARSE_GRAD_STAGE_OPERANDS);
