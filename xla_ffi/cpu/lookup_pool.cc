// Fused gather + weighted pooling on the CPU.
//
//   pooled (sum/mean/sqrtn): out[s] = (sum_i w_i * table[ids_i] over i in segment s) / denom_s
//   none:                    out[i] = w_i * table[ids_i]
//
// Padding ids (< 0 or >= V) and segment ids outside [0, S) contribute nothing; empty bags are
// zero. Segment ids sorted ascending (the SparseFeatures layout) take the fast path: each
// worker pools a contiguous range of bags with SIMD accumulators held in registers (the
// loops of pool_body.inc, compiled for AVX-512, AVX2 and portable C++, and for bfloat16
// outputs once more for AVX-512 with the BF16 conversions, chosen at run time by cpu_isa.h)
// and prefetches the rows of the ids ahead. Unsorted segment ids fall back to workers that
// own a segment range and scan all ids.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_hugepages.h"
#include "cpu_isa.h"
#include "cpu_segments.h"
#include "cpu_simd.h"
#include "embark_abi.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {

// The operands of one call, shared by every instruction set's copy of pool_body.inc.
template <typename T, typename Id>
struct Src {
  const T* table;
  int64_t vocab, d;
  const Id* ids;
  const float* w;  // [N], or null: every weight is 1

  float Weight(int64_t i) const { return w != nullptr ? w[i] : 1.0f; }
};

// The output rows of one call: one or more pieces [S_k, D], rows one after the other (each
// feature of a DP group gets its own output, written where it is: no split copy). Passed by
// value, a copy per worker: Row keeps a cursor, so ascending rows find their piece in O(1).
template <typename O>
struct OutRows {
  O* const* base;
  const int64_t* start;  // [pieces + 1]: piece k holds rows [start[k], start[k + 1])
  int64_t pieces, d;
  int64_t k = 0;

  O* Row(int64_t r) {
    if (pieces == 1) return base[0] + r * d;
    while (r >= start[k + 1]) ++k;
    while (r < start[k]) --k;
    return base[k] + (r - start[k]) * d;
  }
};

namespace pool_scalar {
using Vec = ScalarVec;
#include "pool_body.inc"
}  // namespace pool_scalar

#if EMBARK_HAVE_X86_SIMD
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace pool_avx2 {
using Vec = Avx2Vec;
#include "pool_body.inc"
}  // namespace pool_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace pool_avx512 {
using Vec = Avx512Vec;
#include "pool_body.inc"
}  // namespace pool_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma")
namespace pool_avx512bf16 {  // only its bfloat16-output instances are used (SelectPool)
using Vec = Avx512Bf16Vec;
#include "pool_body.inc"
}  // namespace pool_avx512bf16
#pragma GCC pop_options
#endif

namespace {

using abi::Combiner;
template <typename T, typename Id, typename S, typename O>
struct PoolFns {
  void (*sorted)(const Src<T, Id>&, const S*, Combiner, OutRows<O>, int64_t, int64_t,
                 int64_t, int64_t);
  void (*rows)(const Src<T, Id>&, OutRows<O>, int64_t, int64_t);
};

template <typename T, typename Id, typename S, typename O>
PoolFns<T, Id, S, O> SelectPool(CpuIsa isa) {
#if EMBARK_HAVE_X86_SIMD
  if constexpr (std::is_same_v<O, uint16_t>) {
    if (isa == CpuIsa::AVX512_BF16) {
      return {&pool_avx512bf16::PoolSorted<T, Id, S, O>, &pool_avx512bf16::PoolRows<T, Id, O>};
    }
  }
  if (isa >= CpuIsa::AVX512) {  // AVX512_BF16 too for a float output (no bf16 store to speed)
    return {&pool_avx512::PoolSorted<T, Id, S, O>, &pool_avx512::PoolRows<T, Id, O>};
  }
  if (isa == CpuIsa::AVX2) {
    return {&pool_avx2::PoolSorted<T, Id, S, O>, &pool_avx2::PoolRows<T, Id, O>};
  }
#endif
  (void)isa;
  return {&pool_scalar::PoolSorted<T, Id, S, O>, &pool_scalar::PoolRows<T, Id, O>};
}

// Unsorted segment ids: each worker owns bags [s0, s1) and scans every id.
template <typename T, typename Id, typename S, typename O>
void PoolUnsorted(const Src<T, Id>& s, const S* seg, Combiner combiner, OutRows<O> out,
                  int64_t s0, int64_t s1, int64_t n) {
  const int64_t d = s.d;
  std::vector<float> acc((s1 - s0) * d, 0.0f), denom(s1 - s0, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = static_cast<int64_t>(seg[i]);
    const T* row = pool_scalar::RowOf(s, i);
    if (b < s0 || b >= s1 || row == nullptr) continue;
    float* a = acc.data() + (b - s0) * d;
    const float wi = s.Weight(i);
    for (int64_t j = 0; j < d; ++j) a[j] += wi * Elem<T>::Load(row, j);
    denom[b - s0] += combiner == Combiner::SQRTN ? wi * wi : wi;
  }
  for (int64_t b = s0; b < s1; ++b) {
    float scale = 1.0f, dn = denom[b - s0];
    if (combiner == Combiner::MEAN) scale = dn > 0 ? 1.0f / dn : 0.0f;
    if (combiner == Combiner::SQRTN) scale = dn > 0 ? 1.0f / std::sqrt(dn) : 0.0f;
    O* row = out.Row(b);
    for (int64_t j = 0; j < d; ++j) Elem<O>::Store(row, j, acc[(b - s0) * d + j] * scale);
  }
}

// Pooled combiners. With the sorted hint, the order check runs inside the parallel pass (each
// chunk checks its proportional share of positions, so together they check every adjacent
// pair); a chunk pooling unsorted ids still reads and writes only in bounds, and any unsorted
// pair sends the whole call through the unsorted path, which rewrites every output row.
// Without the hint, the check runs first, serially, so unsorted ids are pooled once.
template <typename T, typename Id, typename S, typename O>
void RunPooled(ffi::ThreadPool& pool, const PoolFns<T, Id, S, O>& fns, const Src<T, Id>& s,
               const S* seg, Combiner combiner, OutRows<O> out, int64_t n, int64_t num_out,
               bool sorted_hint) {
  bool sorted = sorted_hint || AscendingRange(seg, 0, n);
  if (sorted) {
    std::atomic<bool> unsorted{false};
    ParallelFor(pool, num_out, 32, [&](int64_t s0, int64_t s1) {
      if (sorted_hint && !AscendingRange(seg, s0 * n / num_out, s1 * n / num_out)) {
        unsorted.store(true);
      }
      fns.sorted(s, seg, combiner, out, s0, s1, LowerBound(seg, n, s0), LowerBound(seg, n, s1));
    });
    sorted = !unsorted.load();
  }
  if (!sorted) {
    ParallelFor(pool, num_out, 256, [&](int64_t s0, int64_t s1) {
      PoolUnsorted(s, seg, combiner, out, s0, s1, n);
    });
  }
}

template <typename T, typename Id, typename S, typename O>
void Run(ffi::ThreadPool& pool, const Src<T, Id>& s, const S* seg, Combiner combiner,
         OutRows<O> out, int64_t n, int64_t num_out, bool sorted_hint) {
  const PoolFns<T, Id, S, O> fns = SelectPool<T, Id, S, O>(ActiveCpuIsa());
  if (combiner == Combiner::NONE) {
    ParallelFor(pool, n, 256, [&](int64_t a, int64_t b) { fns.rows(s, out, a, b); });
    return;
  }
  RunPooled(pool, fns, s, seg, combiner, out, n, num_out, sorted_hint);
}

ffi::Error LookupPoolImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::AnyBuffer ids,
                          ffi::AnyBuffer seg, ffi::AnyBuffer weights,
                          ffi::Result<ffi::AnyBuffer> workspace, ffi::RemainingRets outs,
                          int64_t combiner, int64_t indices_are_sorted) {
  // The workspace is the CUDA kernel's (same target signature); the CPU needs none.
  // indices_are_sorted is a hint: the order is checked either way (RunPooled).
  (void)workspace;
  const int64_t n = static_cast<int64_t>(ids.element_count());
  std::vector<ffi::AnyBuffer> pieces;
  ffi::Error err = CheckLookupPool(table, ids, seg, weights, outs, combiner, &pieces);
  if (err.failure()) return err;
  NoteRandomAccess(table.untyped_data(), static_cast<int64_t>(table.size_bytes()));
  std::vector<void*> base;
  std::vector<int64_t> start{0};
  for (ffi::AnyBuffer& piece : pieces) {
    NoteFreshOutput(piece.untyped_data(), static_cast<int64_t>(piece.size_bytes()));
    base.push_back(piece.untyped_data());
    start.push_back(start.back() + piece.dimensions()[0]);
  }
  const int64_t vocab = table.dimensions()[0], d = table.dimensions()[1];
  const int64_t num_out = start.back();
  const float* w =  // [0]: unweighted (CheckLookupPool)
      weights.element_count() == 0 ? nullptr : static_cast<const float*>(weights.untyped_data());
  const auto c = static_cast<Combiner>(combiner);
  const ffi::DataType out_type = pieces[0].element_type();
  return DispatchFloat<HostBf16>("lookup_pool", "table", table.element_type(), [&](auto t) {
    return DispatchFloat<HostBf16>("lookup_pool", "output", out_type, [&](auto o) {
      return DispatchId("lookup_pool", "ids", ids.element_type(), [&](auto i) {
        return DispatchId("lookup_pool", "segment_ids", seg.element_type(), [&](auto sg) {
          using T = EMBARK_TYPE(t);
          using O = EMBARK_TYPE(o);
          using Id = EMBARK_TYPE(i);
          using S = EMBARK_TYPE(sg);
          const Src<T, Id> src{static_cast<const T*>(table.untyped_data()), vocab, d,
                               static_cast<const Id*>(ids.untyped_data()), w};
          const OutRows<O> out{reinterpret_cast<O* const*>(base.data()), start.data(),
                               static_cast<int64_t>(base.size()), d};
          Run(pool, src, static_cast<const S*>(seg.untyped_data()), c, out, n, num_out,
              indices_are_sorted != 0);
        });
      });
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
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace (CUDA only)
                                  .RemainingRets()  // [S, D] or [N, D], in pieces
                                  .Attr<int64_t>("combiner")
                                  .Attr<int64_t>("indices_are_sorted"));
