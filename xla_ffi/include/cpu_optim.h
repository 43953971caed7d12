// The sparse optimizers' per-row math on the CPU, shared by sparse_update and the fused
// backward + update kernel. The optimizer ids, the slot layout and the hparams layout are the
// ABI's (embark_abi.h); Adam's bias corrections arrive folded into lr and eps.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "embark_abi.h"
#include "embark_ffi.h"

namespace embark {

using abi::Optimizer;

// Applies one optimizer step to row r of the table with gradient g[0..d).
template <typename T>
inline void ApplyRow(Optimizer opt, T* table, float* sa, float* sb, int64_t r, const float* g,
                     int64_t d, const abi::Hparams& h) {
  const float lr = h.lr, eps = h.eps, b1 = h.b1, b2 = h.b2;
  T* w = table + r * d;
  switch (opt) {
    case Optimizer::SGD:
      for (int64_t j = 0; j < d; ++j) Elem<T>::Store(w, j, Elem<T>::Load(w, j) - lr * g[j]);
      break;
    case Optimizer::ADAGRAD: {
      float* a = sa + r * d;
      for (int64_t j = 0; j < d; ++j) {
        a[j] += g[j] * g[j];
        Elem<T>::Store(w, j, Elem<T>::Load(w, j) - lr * g[j] / (std::sqrt(a[j]) + eps));
      }
      break;
    }
    case Optimizer::ROW_WISE_ADAGRAD: {
      float sq = 0.0f;
      for (int64_t j = 0; j < d; ++j) sq += g[j] * g[j];
      sa[r] += sq / static_cast<float>(d);
      const float step = lr / (std::sqrt(sa[r]) + eps);
      for (int64_t j = 0; j < d; ++j) Elem<T>::Store(w, j, Elem<T>::Load(w, j) - step * g[j]);
      break;
    }
    case Optimizer::ADAM: {
      float* m = sa + r * d;
      float* v = sb + r * d;
      for (int64_t j = 0; j < d; ++j) {
        m[j] = b1 * m[j] + (1.0f - b1) * g[j];
        v[j] = b2 * v[j] + (1.0f - b2) * g[j] * g[j];
        Elem<T>::Store(w, j, Elem<T>::Load(w, j) - lr * m[j] / (std::sqrt(v[j]) + eps));
      }
      break;
    }
  }
}

// Copies src to dst unless XLA aliased them (input_output_aliases).
inline void CopyIfNotAliased(void* dst, const void* src, size_t bytes) {
  if (dst != src) std::memcpy(dst, src, bytes);
}

}  // namespace embark
