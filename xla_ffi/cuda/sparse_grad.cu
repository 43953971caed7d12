// The sparse gradient of a lookup on CUDA, and its fusion with the optimizer.
//
// Both dedup the ids (CUB sort in the workspace) and give one warp per unique row, which
// reduces scale[i] * grads[src(i)] over the row's run in registers (128 columns per chunk,
// coalesced). Runs longer than kLongRun ids (hot ids) are first split into pieces that
// separate warps reduce into partial rows (PiecesKernel); the row's warp then sums its
// pieces instead of walking the run. sparse_grad writes the reduced rows ([C] slots, overflow counted through
// num_unique); sparse_grad_update applies the optimizer to the table row right away
// (in place, outputs alias inputs), with no gradient buffer and no capacity;
// sparse_grad_stage updates the rows in place too, after saving each row's previous weights
// and slots to staging buffers (commit_rows.cu writes them back when the step is undone).
#include <string>
#include <vector>

#include "dedup.cuh"
#include "embark_operands.h"
#include "kernels.h"
#include "optim.cuh"

namespace embark {
namespace {

constexpr int kR = 4;  // columns per lane per chunk: a chunk is 128 columns

struct GradArgs {
  const void* grads;
  bool grads_bf16;
  const void* seg;
  bool seg64;
  bool per_id;
  const float* scale;
  int64_t d, num_src;
};

__device__ __forceinline__ float LoadGrad(const GradArgs& g, int64_t e) {
  return g.grads_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(g.grads)[e])
                      : static_cast<const float*>(g.grads)[e];
}

// Accumulates the 128-column chunk c0 of the sorted ids [t0, t1) into acc[kR] (lane-strided
// columns).
__device__ __forceinline__ void AccumulateRange(const DedupView& v, const GradArgs& g, int64_t t0,
                                                int64_t t1, int64_t c0, float* acc) {
  const int lane = threadIdx.x & 31;
  for (int r = 0; r < kR; ++r) acc[r] = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i = v.positions[t];
    const int64_t src = g.per_id ? i : DevLoadIdAny(g.seg, g.seg64, i);
    if (src < 0 || src >= g.num_src) continue;
    const float c = g.scale[i];
    for (int r = 0; r < kR; ++r) {
      const int64_t j = c0 + lane + 32 * r;
      if (j < g.d) acc[r] += c * LoadGrad(g, src * g.d + j);
    }
  }
}

// Accumulates the 128-column chunk c0 of unique slot k's gradient into acc[kR]: its run, or
// the sum of its pieces' partial rows when the run was split.
__device__ __forceinline__ void AccumulateChunk(const DedupView& v, const GradArgs& g, int64_t k,
                                                int64_t c0, float* acc) {
  if (!IsSplit(v, k)) {
    AccumulateRange(v, g, v.run_start[k], v.run_start[k + 1], c0, acc);
    return;
  }
  const int lane = threadIdx.x & 31;
  for (int r = 0; r < kR; ++r) acc[r] = 0.0f;
  const int64_t end = v.piece_end[k];
  for (int64_t q = end - v.piece_count[k]; q < end; ++q) {
    for (int r = 0; r < kR; ++r) {
      const int64_t j = c0 + lane + 32 * r;
      if (j < g.d) acc[r] += v.partial[q * g.d + j];
    }
  }
}

// One warp per piece of the long runs: reduces the piece's ids into its partial row.
__global__ void PiecesKernel(DedupView v, GradArgs g, int64_t n) {
  const int lane = threadIdx.x & 31;
  const int64_t total = v.piece_end[n - 1];
  for (int64_t q = GridWarp(); q < total; q += GridWarps()) {
    int64_t lo = 0, hi = n - 1;  // the slot: the first k with piece_end[k] > q
    while (lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (v.piece_end[mid] > q) hi = mid; else lo = mid + 1;
    }
    const int64_t p = q - (v.piece_end[lo] - v.piece_count[lo]);
    const int64_t t0 = v.run_start[lo] + p * kPiece;
    const int64_t run_end = v.run_start[lo + 1];
    const int64_t t1 = t0 + kPiece < run_end ? t0 + kPiece : run_end;
    for (int64_t c0 = 0; c0 < g.d; c0 += 32 * kR) {
      float acc[kR];
      AccumulateRange(v, g, t0, t1, c0, acc);
      for (int r = 0; r < kR; ++r) {
        const int64_t j = c0 + lane + 32 * r;
        if (j < g.d) v.partial[q * g.d + j] = acc[r];
      }
    }
  }
}

// Reduces the pieces of the long runs (after RunDedup with d > 0, before the per-row pass).
void LaunchPieces(cudaStream_t stream, const DedupView& v, const GradArgs& g, int64_t n) {
  if (n == 0 || v.piece_count == nullptr) return;
  PiecesKernel<<<GridFor(v.max_pieces, 8), 256, 0, stream>>>(v, g, n);
}

__global__ void SparseGradKernel(DedupView v, bool ids64, GradArgs g, int64_t cap,
                                 void* unique_rows, float* row_grads) {
  const int lane = threadIdx.x & 31;
  const int64_t u = *v.num_unique;
  const int64_t slots = u < cap ? u : cap;
  for (int64_t k = GridWarp(); k < cap; k += GridWarps()) {
    if (lane == 0) {
      const int64_t id = k < slots ? SortedId(v, ids64, v.run_start[k]) : -1;
      if (ids64) static_cast<int64_t*>(unique_rows)[k] = id;
      else static_cast<int32_t*>(unique_rows)[k] = static_cast<int32_t>(id);
    }
    for (int64_t c0 = 0; c0 < g.d; c0 += 32 * kR) {
      float acc[kR];
      if (k < slots) {
        AccumulateChunk(v, g, k, c0, acc);
      } else {
        for (int r = 0; r < kR; ++r) acc[r] = 0.0f;
      }
      for (int r = 0; r < kR; ++r) {
        const int64_t j = c0 + lane + 32 * r;
        if (j < g.d) row_grads[k * g.d + j] = acc[r];
      }
    }
  }
}

// This lane's part of the sum of squares of unique row k's summed gradient (the row-wise
// optimizers reduce it over the warp).
__device__ __forceinline__ float LaneSquares(const DedupView& v, const GradArgs& g, int64_t k) {
  float sq = 0.0f;
  for (int64_t c0 = 0; c0 < g.d; c0 += 32 * kR) {
    float acc[kR];
    AccumulateChunk(v, g, k, c0, acc);
    for (int r = 0; r < kR; ++r) sq += acc[r] * acc[r];
  }
  return sq;
}

template <typename T>
__global__ void SparseGradUpdateKernel(DedupView v, bool ids64, GradArgs g, T* table, float* sa,
                                       float* sb, int64_t vocab, Optimizer opt, const float* hp) {
  const int lane = threadIdx.x & 31;
  const Hparams h = LoadHparams(hp);
  const int64_t u = *v.num_unique;
  for (int64_t k = GridWarp(); k < u; k += GridWarps()) {
    const int64_t row = SortedId(v, ids64, v.run_start[k]);
    if (row < 0 || row >= vocab) continue;
    float step = 0.0f;
    if (opt == Optimizer::ROW_WISE_ADAGRAD) {  // needs the whole row's sum of g^2 first
      const float sq = LaneSquares(v, g, k);
      step = RowWiseStep(sa, row, sq, g.d, h);
    }
    for (int64_t c0 = 0; c0 < g.d; c0 += 32 * kR) {
      float acc[kR];
      AccumulateChunk(v, g, k, c0, acc);
      for (int r = 0; r < kR; ++r) {
        const int64_t j = c0 + lane + 32 * r;
        if (j < g.d) ApplyElem(opt, table, sa, sb, row, j, g.d, acc[r], h, step);
      }
    }
  }
}

// Where sparse_grad_stage writes besides the table: the previous rows and the verdict.
struct StageOut {
  void* rows;
  bool rows64;
  float* a;  // previous slot rows [C, wa]
  float* b;  // [C, wb]
  int64_t wa, wb;
  int32_t* finite;  // set to 0 when any updated value is not finite
};

__device__ __forceinline__ void StoreRow(const StageOut& o, int64_t k, int64_t row) {
  if (o.rows64) static_cast<int64_t*>(o.rows)[k] = row;
  else static_cast<int32_t*>(o.rows)[k] = static_cast<int32_t>(row);
}

__device__ __forceinline__ bool StagedFinite(float v) { return isfinite(v); }
__device__ __forceinline__ bool StagedFinite(__nv_bfloat16 v) {
  return isfinite(__bfloat162float(v));
}

__global__ void SetFlagKernel(int32_t* flag, int32_t value) { *flag = value; }

// One warp per slot k < cap: saves unique row k's weights and slots to `old` and o.a / o.b,
// then updates the row in place (rows are distinct: no two warps touch one row); slots past
// the distinct rows, and rows outside the table, get row -1.
template <typename T>
__global__ void SparseGradStageKernel(DedupView v, bool ids64, GradArgs g, T* table, float* sa,
                                      float* sb, int64_t vocab, Optimizer opt, const float* hp,
                                      int64_t cap, T* old, StageOut o) {
  const int lane = threadIdx.x & 31;
  const Hparams h = LoadHparams(hp);
  const int64_t u = *v.num_unique;
  for (int64_t k = GridWarp(); k < cap; k += GridWarps()) {
    const int64_t row = k < u ? SortedId(v, ids64, v.run_start[k]) : -1;
    if (row < 0 || row >= vocab) {
      if (lane == 0) StoreRow(o, k, -1);
      continue;
    }
    bool finite = true;
    float step = 0.0f;
    if (opt == Optimizer::ROW_WISE_ADAGRAD) {  // needs the whole row's sum of g^2 first
      const float sq = LaneSquares(v, g, k);
      const float prev = sa[row];
      const float a = RowWiseAccumulator(prev, sq, g.d);
      __syncwarp();  // every lane has read sa[row] before lane 0 overwrites it
      if (lane == 0) {
        o.a[k] = prev;
        sa[row] = a;
      }
      finite = isfinite(a);
      step = RowWiseStepSize(a, h);
    }
    for (int64_t c0 = 0; c0 < g.d; c0 += 32 * kR) {
      float acc[kR];
      AccumulateChunk(v, g, k, c0, acc);
      for (int r = 0; r < kR; ++r) {
        const int64_t j = c0 + lane + 32 * r;
        if (j >= g.d) continue;
        const int64_t e = row * g.d + j;
        old[k * g.d + j] = table[e];
        ElemState s{DevElem<T>::Load(table, e), HasElemSlotA(opt) ? sa[e] : 0.0f,
                    HasElemSlotB(opt) ? sb[e] : 0.0f};
        if (HasElemSlotA(opt)) o.a[k * o.wa + j] = s.a;
        if (HasElemSlotB(opt)) o.b[k * o.wb + j] = s.b;
        s = StepElem(opt, s, acc[r], h, step);
        if (HasElemSlotA(opt)) {
          sa[e] = s.a;
          finite &= isfinite(s.a);
        }
        if (HasElemSlotB(opt)) {
          sb[e] = s.b;
          finite &= isfinite(s.b);
        }
        StoreUpdated(table, e, row, j, s.w, h);
        finite &= StagedFinite(table[e]);
      }
    }
    if (lane == 0) StoreRow(o, k, row);
    if (__any_sync(0xffffffffu, !finite) && lane == 0) atomicAnd(o.finite, 0);
  }
}

GradArgs MakeGradArgs(const ffi::AnyBuffer& grads, const ffi::AnyBuffer& seg, bool per_id,
                      const float* scale) {
  return GradArgs{grads.untyped_data(), grads.element_type() == ffi::DataType::BF16,
                  seg.untyped_data(), seg.element_type() == ffi::DataType::S64, per_id, scale,
                  grads.dimensions()[1], grads.dimensions()[0]};
}

ffi::Error SparseGradCudaImpl(cudaStream_t stream, ffi::AnyBuffer grads, ffi::AnyBuffer ids,
                              ffi::AnyBuffer seg, ffi::Buffer<ffi::F32> scale,
                              ffi::Result<ffi::AnyBuffer> unique_rows,
                              ffi::Result<ffi::Buffer<ffi::F32>> row_grads,
                              ffi::Result<ffi::Buffer<ffi::S32>> num_unique,
                              ffi::Result<ffi::AnyBuffer> workspace, int64_t per_id) {
  ffi::Error err =
      CheckSparseGrad(grads, ids, seg, scale, *unique_rows, *row_grads, *num_unique,
                      per_id != 0);
  if (err.failure()) return err;
  const bool ids64 = ids.element_type() == ffi::DataType::S64;
  const int64_t cap = static_cast<int64_t>(unique_rows->element_count());
  DedupView v;
  const int64_t n = static_cast<int64_t>(ids.element_count());
  err = RunDedup(stream, ids.untyped_data(), ids64, n, /*vocab=*/0, grads.dimensions()[1],
                 workspace->untyped_data(), workspace->size_bytes(), num_unique->typed_data(), &v);
  if (err.failure()) return err;
  GradArgs g = MakeGradArgs(grads, seg, per_id != 0, scale.typed_data());
  LaunchPieces(stream, v, g, n);
  SparseGradKernel<<<GridFor(cap, 8), 256, 0, stream>>>(
      v, ids64, g, cap, unique_rows->untyped_data(), row_grads->typed_data());
  return CudaStatus("sparse_grad");
}

ffi::Error SparseGradUpdateCudaImpl(
    cudaStream_t stream, ffi::AnyBuffer table, ffi::Buffer<ffi::F32> slot_a,
    ffi::Buffer<ffi::F32> slot_b, ffi::AnyBuffer grads, ffi::AnyBuffer ids, ffi::AnyBuffer seg,
    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> hparams,
    ffi::Result<ffi::AnyBuffer> table_out, ffi::Result<ffi::Buffer<ffi::F32>> slot_a_out,
    ffi::Result<ffi::Buffer<ffi::F32>> slot_b_out, ffi::Result<ffi::Buffer<ffi::S32>> num_unique,
    ffi::Result<ffi::AnyBuffer> workspace, int64_t optimizer, int64_t per_id) {
  ffi::Error err = CheckSparseGradUpdate(table, slot_a, slot_b, grads, ids, seg, scale, hparams,
                                         optimizer, per_id != 0, *table_out, *slot_a_out,
                                         *slot_b_out, *num_unique);
  if (err.failure()) return err;
  err = StartFromInputs("sparse_grad_update", stream,
                        {Same(table_out, table), Same(slot_a_out, slot_a), Same(slot_b_out, slot_b)});
  if (err.failure()) return err;
  const bool ids64 = ids.element_type() == ffi::DataType::S64;
  DedupView v;
  // ids >= V are padding here (the update skips them), so the sort needs only V's bits.
  const int64_t n = static_cast<int64_t>(ids.element_count());
  err = RunDedup(stream, ids.untyped_data(), ids64, n, table.dimensions()[0],
                 table.dimensions()[1], workspace->untyped_data(), workspace->size_bytes(),
                 num_unique->typed_data(), &v);
  if (err.failure()) return err;
  GradArgs g = MakeGradArgs(grads, seg, per_id != 0, scale.typed_data());
  LaunchPieces(stream, v, g, n);
  const unsigned grid = GridFor(static_cast<int64_t>(ids.element_count()), 8);
  err = DispatchFloat<DevBf16>("sparse_grad_update", "table", table.element_type(), [&](auto tag) {
    using T = EMBARK_TYPE(tag);
    SparseGradUpdateKernel<T><<<grid, 256, 0, stream>>>(
        v, ids64, g, static_cast<T*>(table_out->untyped_data()), slot_a_out->typed_data(),
        slot_b_out->typed_data(), table.dimensions()[0], static_cast<Optimizer>(optimizer),
        hparams.typed_data());
  });
  if (err.failure()) return err;
  return CudaStatus("sparse_grad_update");
}

ffi::Error SparseGradStageCudaImpl(
    cudaStream_t stream, ffi::AnyBuffer table, ffi::Buffer<ffi::F32> slot_a,
    ffi::Buffer<ffi::F32> slot_b, ffi::AnyBuffer ids, ffi::AnyBuffer seg,
    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> hparams,
    ffi::AnyBuffer /*staging values: aliased, never read*/, ffi::AnyBuffer /*staging a*/,
    ffi::AnyBuffer /*staging b*/, ffi::RemainingArgs grad_pieces,
    ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> values,
    ffi::Result<ffi::Buffer<ffi::F32>> staged_a, ffi::Result<ffi::Buffer<ffi::F32>> staged_b,
    ffi::Result<ffi::Buffer<ffi::S32>> num_unique, ffi::Result<ffi::Buffer<ffi::S32>> finite,
    ffi::Result<ffi::AnyBuffer> workspace, ffi::Result<ffi::AnyBuffer> table_out,
    ffi::Result<ffi::Buffer<ffi::F32>> slot_a_out, ffi::Result<ffi::Buffer<ffi::F32>> slot_b_out,
    int64_t optimizer, int64_t per_id) {
  std::vector<ffi::AnyBuffer> pieces;
  ffi::Error err = CheckSparseGradStage(
      table, slot_a, slot_b, ids, seg, scale, hparams, grad_pieces, optimizer, per_id != 0,
      *rows, *values, *staged_a, *staged_b, *num_unique, *finite, *table_out, *slot_a_out,
      *slot_b_out, &pieces);
  if (err.failure()) return err;
  err = StartFromInputs("sparse_grad_stage", stream,
                        {Same(table_out, table), Same(slot_a_out, slot_a), Same(slot_b_out, slot_b)});
  if (err.failure()) return err;
  // One piece on the GPU: ops._ffi concatenates the pieces there (a device copy is cheap next
  // to the host's page faults that the pieces avoid).
  if (pieces.size() != 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sparse_grad_stage: the CUDA kernel takes grads as one [S, D] piece, got " +
                          std::to_string(pieces.size()));
  }
  const ffi::AnyBuffer& grads = pieces[0];
  const bool ids64 = ids.element_type() == ffi::DataType::S64;
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const TableRows block = RowsOf(table);
  const int64_t vocab = block.vocab, d = block.d;
  DedupView v;
  err = RunDedup(stream, ids.untyped_data(), ids64, n, vocab, d, workspace->untyped_data(),
                 workspace->size_bytes(), num_unique->typed_data(), &v);
  if (err.failure()) return err;
  GradArgs g = MakeGradArgs(grads, seg, per_id != 0, scale.typed_data());
  LaunchPieces(stream, v, g, n);
  SetFlagKernel<<<1, 1, 0, stream>>>(finite->typed_data(), 1);
  const StageOut o{rows->untyped_data(),
                   rows->element_type() == ffi::DataType::S64,
                   staged_a->typed_data(),
                   staged_b->typed_data(),
                   abi::SlotRowWidth(optimizer, 0, d),
                   abi::SlotRowWidth(optimizer, 1, d),
                   finite->typed_data()};
  err = DispatchFloat<DevBf16>("sparse_grad_stage", "table", table.element_type(), [&](auto tag) {
    using T = EMBARK_TYPE(tag);
    const int64_t cap = static_cast<int64_t>(rows->element_count());  // >= min(n, vocab)
    SparseGradStageKernel<T><<<GridFor(cap, 8), 256, 0, stream>>>(
        v, ids64, g, static_cast<T*>(table_out->untyped_data()), slot_a_out->typed_data(),
        slot_b_out->typed_data(), vocab, static_cast<Optimizer>(optimizer), hparams.typed_data(), cap,
        static_cast<T*>(values->untyped_data()), o);
  });
  if (err.failure()) return err;
  return CudaStatus("sparse_grad_stage");
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSparseGradCuda, embark::SparseGradCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("per_id"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSparseGradUpdateCuda, embark::SparseGradUpdateCudaImpl,
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  EMBARK_SPARSE_GRAD_UPDATE_OPERANDS,
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSparseGradStageCuda, embark::SparseGradStageCudaImpl,
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  EMBARK_SPARSE_GRAD_STAGE_OPERANDS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
