// The sparse optimizers' per-row math on the CPU, shared by sparse_update and the fused
// backward + update kernel. hp = [lr, eps, b1, b2] (Adam's bias corrections folded in).
#pragma once

#include <cmath>
#include <cstdint>

#include "embark_ffi.h"

namespace embark {

enum Optimizer : int64_t { kSgd = 0, kAdagrad = 1, kRowWiseAdagrad = 2, kAdam = 3 };

inline bool ValidOptimizer(int64_t opt) { return opt >= kSgd && opt <= kAdam; }

// Number of float32 slot elements the optimizer needs in slot a / slot b for a [V, D] table.
inline int64_t SlotAElements(int64_t opt, int64_t vocab, int64_t d) {
  return opt == kAdagrad || opt == kAdam ? vocab * d : opt == kRowWiseAdagrad ? vocab : 0;
}
inline int64_t SlotBElements(int64_t opt, int64_t vocab, int64_t d) {
  return opt == kAdam ? vocab * d : 0;
}

// Applies one optimizer step to row r of the table with gradient g[0..d).
template <typename T>
inline void ApplyRow(int64_t opt, T* table, float* sa, float* sb, int64_t r, const float* g,
                     int64_t d, const float* hp) {
  const float lr = hp[0], eps = hp[1], b1 = hp[2], b2 = hp[3];
  T* w = table + r * d;
  switch (opt) {
    case kSgd:
      for (int64_t j = 0; j < d; ++j) Elem<T>::Store(w, j, Elem<T>::Load(w, j) - lr * g[j]);
      break;
    case kAdagrad: {
      float* a = sa + r * d;
      for (int64_t j = 0; j < d; ++j) {
        a[j] += g[j] * g[j];
        Elem<T>::Store(w, j, Elem<T>::Load(w, j) - lr * g[j] / (std::sqrt(a[j]) + eps));
      }
      break;
    }
    case kRowWiseAdagrad: {
      float sq = 0.0f;
      for (int64_t j = 0; j < d; ++j) sq += g[j] * g[j];
      sa[r] += sq / static_cast<float>(d);
      const float step = lr / (std::sqrt(sa[r]) + eps);
      for (int64_t j = 0; j < d; ++j) Elem<T>::Store(w, j, Elem<T>::Load(w, j) - step * g[j]);
      break;
    }
    case kAdam: {
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
