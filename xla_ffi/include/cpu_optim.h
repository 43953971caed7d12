// The sparse optimizers' per-row math on the CPU, shared by sparse_update and the fused
// backward + update kernel. The optimizer ids, the slot layout and the hparams layout are the
// ABI's (embark_abi.h); Adam's bias corrections arrive folded into lr and eps. A bfloat16
// table's updated elements are rounded to nearest even, or stochastically when the hparams
// say so (abi::StochasticBf16, random bits hashed from the seed, row and column).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "embark_abi.h"
#include "embark_ffi.h"

namespace embark {

using abi::Optimizer;

// Stores the updated value v as element j of a table row: float32 exactly; bfloat16 to
// nearest even, or stochastically with the bits of (row_key, j) when `stochastic`.
template <typename T>
struct RowStore;
template <>
struct RowStore<float> {
  static inline void Store(float* w, int64_t j, float v, bool, uint32_t) { w[j] = v; }
};
template <>
struct RowStore<uint16_t> {
  static inline void Store(uint16_t* w, int64_t j, float v, bool stochastic, uint32_t row_key) {
    if (!stochastic) {
      w[j] = FloatToBf16(v);
      return;
    }
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    w[j] = abi::StochasticBf16(bits, abi::ElementBits(row_key, j));
  }
};

// Applies one optimizer step to row r of the table with gradient g[0..d).
template <typename T>
inline void ApplyRow(Optimizer opt, T* table, float* sa, float* sb, int64_t r, const float* g,
                     int64_t d, const abi::Hparams& h) {
  const float lr = h.lr, eps = h.eps, b1 = h.b1, b2 = h.b2;
  const bool sr = h.stochastic;
  const uint32_t key = sr ? abi::RowKey(h.seed, r) : 0u;
  T* w = table + r * d;
  auto store = [w, sr, key](int64_t j, float v) { RowStore<T>::Store(w, j, v, sr, key); };
  switch (opt) {
    case Optimizer::SGD:
      for (int64_t j = 0; j < d; ++j) store(j, Elem<T>::Load(w, j) - lr * g[j]);
      break;
    case Optimizer::ADAGRAD: {
      float* a = sa + r * d;
      for (int64_t j = 0; j < d; ++j) {
        a[j] += g[j] * g[j];
        store(j, Elem<T>::Load(w, j) - lr * g[j] / (std::sqrt(a[j]) + eps));
      }
      break;
    }
    case Optimizer::ROW_WISE_ADAGRAD: {
      float sq = 0.0f;
      for (int64_t j = 0; j < d; ++j) sq += g[j] * g[j];
      sa[r] += sq / static_cast<float>(d);
      const float step = lr / (std::sqrt(sa[r]) + eps);
      for (int64_t j = 0; j < d; ++j) store(j, Elem<T>::Load(w, j) - step * g[j]);
      break;
    }
    case Optimizer::ADAM: {
      float* m = sa + r * d;
      float* v = sb + r * d;
      for (int64_t j = 0; j < d; ++j) {
        m[j] = b1 * m[j] + (1.0f - b1) * g[j];
        v[j] = b2 * v[j] + (1.0f - b2) * g[j] * g[j];
        store(j, Elem<T>::Load(w, j) - lr * m[j] / (std::sqrt(v[j]) + eps));
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
