// The sparse optimizers' per-row math on the CPU, shared by sparse_update and the fused
// backward + update kernel. The optimizer ids, the slot layout and the hparams layout are the
// ABI's (embark_abi.h); Adam's bias corrections arrive folded into lr and eps. A bfloat16
// table's updated elements are rounded to nearest even, or stochastically when the hparams
// say so (abi::StochasticBf16, random bits hashed from the seed, row and column).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_hugepages.h"
#include "embark_abi.h"
#include "embark_ffi.h"

// Forces inlining of the per-row math into the kernels' per-instruction-set loops.
#define EMBARK_OPTIM_INLINE inline __attribute__((always_inline))

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

// One row's weights and optimizer slots: read from the `in` pointers, the updated values
// written to the `out` pointers. An in-place update points both at the table's row r; a
// staged update reads the table's row and writes a staging row (nothing of the table).
// Slot a/b point at the row's per-element slots (d floats) or its per-row slot (1 float),
// as the optimizer's ABI footprint says; unused ones are never touched.
template <typename T>
struct RowIO {
  const T* w;
  const float* a;
  const float* b;
  T* w_out;
  float* a_out;
  float* b_out;
};

// Whether every stored element is finite (an update that overflowed bfloat16's range is not):
// the largest exponent field over the row, an integer max that vectorises.
inline bool AllStoredFinite(const float* v, int64_t n) {
  uint32_t top = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, v + j, sizeof(bits));
    const uint32_t e = bits & 0x7f800000u;
    top = e > top ? e : top;
  }
  return top != 0x7f800000u;
}
inline bool AllStoredFinite(const uint16_t* v, int64_t n) {
  uint32_t top = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t e = v[j] & 0x7f80u;
    top = e > top ? e : top;
  }
  return top != 0x7f80u;
}

// Sum of g[j]^2: 16 partial sums (lane l takes j = l mod 16), added in a fixed order, so the
// loop vectorises and the result is the same on every instruction set; rows of fewer than
// 16 elements are summed in order.
EMBARK_OPTIM_INLINE float SumOfSquares(const float* g, int64_t d) {
  constexpr int64_t kLanes = 16;
  if (d < kLanes) {
    float sq = 0.0f;
    for (int64_t j = 0; j < d; ++j) sq += g[j] * g[j];
    return sq;
  }
  float part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += g[j + l] * g[j + l];
  }
  for (int64_t l = 0; j < d; ++j, ++l) part[l] += g[j] * g[j];
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) part[l] += part[l + w];
  }
  return part[0];
}

// Applies one optimizer step to the row `io` (row r of the table: r keys the stochastic
// rounding) with gradient g[0..d). With kCheck, returns whether every value written is finite
// (a staged update's verdict), checked after the row is written; without, true. Inlined into
// its callers so that their per-instruction-set copies vectorise it.
template <bool kCheck, typename T>
EMBARK_OPTIM_INLINE bool UpdateRow(Optimizer opt, const RowIO<T>& io, int64_t r, const float* g,
                                   int64_t d, const abi::Hparams& h) {
  const float lr = h.lr, eps = h.eps, b1 = h.b1, b2 = h.b2;
  const bool sr = h.stochastic;
  const uint32_t key = sr ? abi::RowKey(h.seed, r) : 0u;
  // Not restrict: an in-place update reads and writes the same row (element j is read
  // before it is written, so the compiler's run-time alias check still vectorises).
  T* w = io.w_out;
  const T* w_in = io.w;
  float* a_out = io.a_out;
  float* b_out = io.b_out;
  int64_t wa = 0, wb = 0;  // slot floats written
  switch (opt) {
    case Optimizer::SGD:
      for (int64_t j = 0; j < d; ++j) {
        RowStore<T>::Store(w, j, Elem<T>::Load(w_in, j) - lr * g[j], sr, key);
      }
      break;
    case Optimizer::ADAGRAD:
      for (int64_t j = 0; j < d; ++j) {
        const float a = io.a[j] + g[j] * g[j];
        a_out[j] = a;
        RowStore<T>::Store(w, j, Elem<T>::Load(w_in, j) - lr * g[j] / (std::sqrt(a) + eps), sr,
                           key);
      }
      wa = d;
      break;
    case Optimizer::ROW_WISE_ADAGRAD: {
      const float a = io.a[0] + SumOfSquares(g, d) / static_cast<float>(d);
      a_out[0] = a;
      const float step = lr / (std::sqrt(a) + eps);
      for (int64_t j = 0; j < d; ++j) {
        RowStore<T>::Store(w, j, Elem<T>::Load(w_in, j) - step * g[j], sr, key);
      }
      wa = 1;
      break;
    }
    case Optimizer::ADAM:
      for (int64_t j = 0; j < d; ++j) {
        const float m = b1 * io.a[j] + (1.0f - b1) * g[j];
        const float v = b2 * io.b[j] + (1.0f - b2) * g[j] * g[j];
        a_out[j] = m;
        b_out[j] = v;
        RowStore<T>::Store(w, j, Elem<T>::Load(w_in, j) - lr * m / (std::sqrt(v) + eps), sr, key);
      }
      wa = wb = d;
      break;
  }
  if (!kCheck) return true;
  return AllStoredFinite(w, d) && AllStoredFinite(a_out, wa) && AllStoredFinite(b_out, wb);
}

// Row r's slot pointer in a slot operand of optimizer `opt` (slot 0 = a, 1 = b): per-element
// slots hold d floats a row, per-row slots one; nullptr when the optimizer has no such slot.
inline float* SlotRow(Optimizer opt, int slot, float* base, int64_t r, int64_t d) {
  const int64_t width = abi::SlotRowWidth(static_cast<int64_t>(opt), slot, d);
  return width ? base + r * width : nullptr;
}

// Applies one optimizer step to row r of the table and its slots, in place.
template <typename T>
inline void ApplyRow(Optimizer opt, T* table, float* sa, float* sb, int64_t r, const float* g,
                     int64_t d, const abi::Hparams& h) {
  float* a = SlotRow(opt, 0, sa, r, d);
  float* b = SlotRow(opt, 1, sb, r, d);
  UpdateRow<false>(opt, RowIO<T>{table + r * d, a, b, table + r * d, a, b}, r, g, d, h);
}

// Copies src to dst unless XLA aliased them (input_output_aliases).
inline void CopyIfNotAliased(void* dst, const void* src, size_t bytes) {
  if (dst != src) std::memcpy(dst, src, bytes);
}

// The table and slot outputs of an in-place update start as their inputs: copied only where
// XLA did not alias them. A table updated in place is reported for huge-page advice.
inline void StartTableAndSlots(const ffi::AnyBuffer& table, const ffi::Buffer<ffi::F32>& slot_a,
                               const ffi::Buffer<ffi::F32>& slot_b,
                               const ffi::AnyBuffer& table_out,
                               const ffi::Buffer<ffi::F32>& slot_a_out,
                               const ffi::Buffer<ffi::F32>& slot_b_out) {
  CopyIfNotAliased(table_out.untyped_data(), table.untyped_data(), table.size_bytes());
  NoteUpdatedTable(table.untyped_data(), table_out.untyped_data(),
                   static_cast<int64_t>(table.size_bytes()));
  CopyIfNotAliased(slot_a_out.untyped_data(), slot_a.untyped_data(), slot_a.size_bytes());
  CopyIfNotAliased(slot_b_out.untyped_data(), slot_b.untyped_data(), slot_b.size_bytes());
}

}  // namespace embark
