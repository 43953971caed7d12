// The sparse optimizers' per-element math on the GPU (same formulas as cpu_optim.h).
#pragma once

#include "common.cuh"

namespace embark {

enum DevOptimizer : int64_t { kDevSgd = 0, kDevAdagrad = 1, kDevRowWiseAdagrad = 2, kDevAdam = 3 };

struct Hparams {
  float lr, eps, b1, b2;
};

__device__ __forceinline__ Hparams LoadHparams(const float* hp) {
  return Hparams{hp[0], hp[1], hp[2], hp[3]};
}

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

// Applies the optimizer to element (r, j) with gradient g; rowwise_step is used by
// row-wise Adagrad only.
template <typename T>
__device__ __forceinline__ void ApplyElem(int64_t opt, T* table, float* sa, float* sb, int64_t r,
                                          int64_t j, int64_t d, float g, const Hparams& h,
                                          float rowwise_step) {
  const int64_t e = r * d + j;
  float w = DevElem<T>::Load(table, e);
  switch (opt) {
    case kDevSgd:
      w -= h.lr * g;
      break;
    case kDevAdagrad: {
      float a = sa[e] + g * g;
      sa[e] = a;
      w -= h.lr * g / (sqrtf(a) + h.eps);
      break;
    }
    case kDevRowWiseAdagrad:
      w -= rowwise_step * g;
      break;
    case kDevAdam: {
      float m = h.b1 * sa[e] + (1.0f - h.b1) * g;
      float v = h.b2 * sb[e] + (1.0f - h.b2) * g * g;
      sa[e] = m;
      sb[e] = v;
      w -= h.lr * m / (sqrtf(v) + h.eps);
      break;
    }
  }
  DevElem<T>::Store(table, e, w);
}

}  // namespace embark
