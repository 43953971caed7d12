// The sparse optimizers' per-element math on the GPU (same formulas as cpu_optim.h). The
// optimizer ids, slot layout and hparams layout are the ABI's (embark_abi.h), and so is the
// stochastic rounding of bfloat16 tables (abi::StochasticBf16: the same bits as on the CPU).
#pragma once

#include "common.cuh"
#include "embark_abi.h"

namespace embark {

using abi::Hparams;
using abi::LoadHparams;
using abi::Optimizer;

// Row-wise Adagrad's accumulator after a row's step: acc + mean(g^2), the whole warp's
// partial sums of g^2 reduced (every lane gets the value).
__device__ __forceinline__ float RowWiseAccumulator(float acc, float partial_sq, int64_t d) {
  return acc + WarpSum(partial_sq) / static_cast<float>(d);
}

// Row-wise Adagrad's step size lr / (sqrt(acc) + eps) for the row's new accumulator.
__device__ __forceinline__ float RowWiseStepSize(float acc, const Hparams& h) {
  return h.lr / (sqrtf(acc) + h.eps);
}

// Row-wise Adagrad in place: called by a whole warp with this lane's partial sum of g^2;
// updates the row's accumulator once and returns the row's step size to all lanes.
__device__ __forceinline__ float RowWiseStep(float* acc, int64_t r, float partial_sq, int64_t d,
                                             const Hparams& h) {
  const float a = RowWiseAccumulator(acc[r], partial_sq, d);
  if ((threadIdx.x & 31) == 0) acc[r] = a;
  return RowWiseStepSize(a, h);
}

// Stores the updated value w as element e of `out`, which holds element (r, j) of the table
// (the table itself, or a staging row): float32 exactly; bfloat16 to nearest even, or
// stochastically with the bits hashed from (seed, r, j) when h.stochastic.
template <typename T>
__device__ __forceinline__ void StoreUpdated(T* out, int64_t e, int64_t, int64_t, float w,
                                             const Hparams&) {
  DevElem<T>::Store(out, e, w);
}
template <>
__device__ __forceinline__ void StoreUpdated<__nv_bfloat16>(__nv_bfloat16* out, int64_t e,
                                                            int64_t r, int64_t j, float w,
                                                            const Hparams& h) {
  if (!h.stochastic) {
    DevElem<__nv_bfloat16>::Store(out, e, w);
    return;
  }
  const uint32_t bits = abi::ElementBits(abi::RowKey(h.seed, r), j);
  out[e] = __ushort_as_bfloat16(abi::StochasticBf16(__float_as_uint(w), bits));
}

// One element's weight and per-element slots (a: Adagrad's accumulator or Adam's m; b: Adam's
// v; unused ones are left as they are).
struct ElemState {
  float w, a, b;
};

// The optimizer's step of one element with gradient g; rowwise_step is row-wise Adagrad's
// step size (its accumulator is per row, updated by the caller).
__device__ __forceinline__ ElemState StepElem(Optimizer opt, ElemState s, float g,
                                              const Hparams& h, float rowwise_step) {
  switch (opt) {
    case Optimizer::SGD:
      s.w -= h.lr * g;
      break;
    case Optimizer::ADAGRAD:
      s.a += g * g;
      s.w -= h.lr * g / (sqrtf(s.a) + h.eps);
      break;
    case Optimizer::ROW_WISE_ADAGRAD:
      s.w -= rowwise_step * g;
      break;
    case Optimizer::ADAM:
      s.a = h.b1 * s.a + (1.0f - h.b1) * g;
      s.b = h.b2 * s.b + (1.0f - h.b2) * g * g;
      s.w -= h.lr * s.a / (sqrtf(s.b) + h.eps);
      break;
  }
  return s;
}

// Whether optimizer `opt` keeps per-element slots a / b (the ABI's footprint).
__device__ __forceinline__ bool HasElemSlotA(Optimizer opt) {
  return abi::SlotsPerElement(static_cast<int64_t>(opt)) >= 1;
}
__device__ __forceinline__ bool HasElemSlotB(Optimizer opt) {
  return abi::SlotsPerElement(static_cast<int64_t>(opt)) >= 2;
}

// Applies the optimizer to element (r, j) of the table in place with gradient g;
// rowwise_step is used by row-wise Adagrad only.
template <typename T>
__device__ __forceinline__ void ApplyElem(Optimizer opt, T* table, float* sa, float* sb, int64_t r,
                                          int64_t j, int64_t d, float g, const Hparams& h,
                                          float rowwise_step) {
  const int64_t e = r * d + j;
  ElemState s{DevElem<T>::Load(table, e), HasElemSlotA(opt) ? sa[e] : 0.0f,
              HasElemSlotB(opt) ? sb[e] : 0.0f};
  s = StepElem(opt, s, g, h, rowwise_step);
  if (HasElemSlotA(opt)) sa[e] = s.a;
  if (HasElemSlotB(opt)) sb[e] = s.b;
  StoreUpdated(table, e, r, j, s.w, h);
}

}  // namespace embark
