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

// Row-wise Adagrad: called by a whole warp with this lane's partial sum of g^2; updates the
// row's accumulator once and returns the row's step size lr / (sqrt(acc) + eps) to all lanes.
__device__ __forceinline__ float RowWiseStep(float* acc, int64_t r, float partial_sq, int64_t d,
                                             const Hparams& h) {
  float sq = WarpSum(partial_sq);
  float step = 0.0f;
  if ((threadIdx.x & 31) == 0) {
    float a = acc[r] + sq / static_cast<float>(d);
    acc[r] = a;
    step = h.lr / (sqrtf(a) + h.eps);
  }
  return __shfl_sync(0xffffffffu, step, 0);
}

// Stores the updated value w as element e = (r, j) of the table: float32 exactly; bfloat16 to
// nearest even, or stochastically with the bits hashed from (seed, r, j) when h.stochastic.
template <typename T>
__device__ __forceinline__ void StoreUpdated(T* table, int64_t e, int64_t, int64_t, float w,
                                             const Hparams&) {
  DevElem<T>::Store(table, e, w);
}
template <>
__device__ __forceinline__ void StoreUpdated<__nv_bfloat16>(__nv_bfloat16* table, int64_t e,
                                                            int64_t r, int64_t j, float w,
                                                            const Hparams& h) {
  if (!h.stochastic) {
    DevElem<__nv_bfloat16>::Store(table, e, w);
    return;
  }
  const uint32_t bits = abi::ElementBits(abi::RowKey(h.seed, r), j);
  table[e] = __ushort_as_bfloat16(abi::StochasticBf16(__float_as_uint(w), bits));
}

// Applies the optimizer to element (r, j) with gradient g; rowwise_step is used by
// row-wise Adagrad only.
template <typename T>
__device__ __forceinline__ void ApplyElem(Optimizer opt, T* table, float* sa, float* sb, int64_t r,
                                          int64_t j, int64_t d, float g, const Hparams& h,
                                          float rowwise_step) {
  const int64_t e = r * d + j;
  float w = DevElem<T>::Load(table, e);
  switch (opt) {
    case Optimizer::SGD:
      w -= h.lr * g;
      break;
    case Optimizer::ADAGRAD: {
      float a = sa[e] + g * g;
      sa[e] = a;
      w -= h.lr * g / (sqrtf(a) + h.eps);
      break;
    }
    case Optimizer::ROW_WISE_ADAGRAD:
      w -= rowwise_step * g;
      break;
    case Optimizer::ADAM: {
      float m = h.b1 * sa[e] + (1.0f - h.b1) * g;
      float v = h.b2 * sb[e] + (1.0f - h.b2) * g * g;
      sa[e] = m;
      sb[e] = v;
      w -= h.lr * m / (sqrtf(v) + h.eps);
      break;
    }
  }
  StoreUpdated(table, e, r, j, w, h);
}

}  // namespace embark
