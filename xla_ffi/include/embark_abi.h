// The kernel ABI of embark_jax: everything Python and the native handlers must agree on, in
// one place. The CPU and CUDA backends include this header; the Python mirror is
// embark_jax/ops/abi.py, and tests/test_abi.py parses the X-macro lists below to check that
// the mirror has exactly the same names and values. To change the ABI, edit the lists here
// and the mirror together (BUILD.md, "The kernel ABI").
//
// Each list is an X-macro: EMBARK_ABI_<LIST>(X) expands X(...) once per entry, so the enums,
// their counts, the handler declarations and the Python module's registrations are generated
// from the one list and cannot drift apart. Keep each entry `X(field, field, ...)` with plain
// names and integer literals, no expressions: the Python test reads this text. The names are
// the same in both languages (hence UPPER_CASE enumerators, in scoped enums so that they
// stay out of the enclosing namespace).
//
// Plain C++17, no XLA or CUDA headers: usable from host code, device code and .cc/.cu alike.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EMBARK_HOST_DEVICE __host__ __device__
#else
#define EMBARK_HOST_DEVICE
#endif

// Combiner of embark_lookup_pool (its `combiner` attribute): X(NAME, id).
#define EMBARK_ABI_COMBINERS(X) \
  X(SUM, 0)                     \
  X(MEAN, 1)                    \
  X(SQRTN, 2)                   \
  X(NONE, 3)

// Optimizer of embark_sparse_update / embark_sparse_grad_update (their `optimizer`
// attribute): X(NAME, id, float32 slots per table element, float32 slots per row). The two
// slot operands hold the per-element slots first (Adam: slot a = m, slot b = v), then the
// per-row ones (row-wise Adagrad: slot a = one accumulator per row); unused slots are [1].
#define EMBARK_ABI_OPTIMIZERS(X) \
  X(SGD, 0, 0, 0)                \
  X(ADAGRAD, 1, 1, 0)            \
  X(ROW_WISE_ADAGRAD, 2, 0, 1)   \
  X(ADAM, 3, 2, 0)

// Layout of the float32 `hparams` operand of the optimizer kernels: X(NAME, index). Adam's
// bias corrections are folded into LR and EPS by the caller; entries an optimizer does not
// use are 0.
#define EMBARK_ABI_HPARAMS(X) \
  X(LR, 0)                    \
  X(EPS, 1)                   \
  X(B1, 2)                    \
  X(B2, 3)

// The FFI targets: X(name, HandlerStem). The target is registered as "embark_<name>" on
// every platform; its handlers are the symbols Embark<HandlerStem>Cpu (cpu/) and
// Embark<HandlerStem>Cuda (cuda/), declared from this list by each backend's kernels.h.
#define EMBARK_ABI_TARGETS(X)            \
  X(segment_sum, SegmentSum)             \
  X(lookup_pool, LookupPool)             \
  X(unique, Unique)                      \
  X(sparse_grad, SparseGrad)             \
  X(sparse_update, SparseUpdate)         \
  X(sparse_grad_update, SparseGradUpdate)

// The target name of a list entry: EMBARK_ABI_TARGET_NAME(lookup_pool) == "embark_lookup_pool".
#define EMBARK_ABI_TARGET_NAME(name) "embark_" #name

namespace embark {
namespace abi {

// Helpers that pick fields out of the list entries (lists of 2 and of 4 fields).
#define EMBARK_ABI_ENUMERATOR(name, value) name = value,
#define EMBARK_ABI_ENUMERATOR4(name, value, per_element, per_row) name = value,
#define EMBARK_ABI_VALUE(name, value) value,
#define EMBARK_ABI_VALUE4(name, value, per_element, per_row) value,
#define EMBARK_ABI_PER_ELEMENT(name, value, per_element, per_row) per_element,
#define EMBARK_ABI_PER_ROW(name, value, per_element, per_row) per_row,
#define EMBARK_ABI_NAME(name, value) #name,
#define EMBARK_ABI_NAME4(name, value, per_element, per_row) #name,

enum class Combiner : int64_t { EMBARK_ABI_COMBINERS(EMBARK_ABI_ENUMERATOR) };
enum class Optimizer : int64_t { EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_ENUMERATOR4) };
enum class Hparam : int64_t { EMBARK_ABI_HPARAMS(EMBARK_ABI_ENUMERATOR) };

constexpr int64_t kCombinerIds[] = {EMBARK_ABI_COMBINERS(EMBARK_ABI_VALUE)};
constexpr int64_t kOptimizerIds[] = {EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_VALUE4)};
constexpr int64_t kHparamIndices[] = {EMBARK_ABI_HPARAMS(EMBARK_ABI_VALUE)};
constexpr int64_t kSlotsPerElement[] = {EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_PER_ELEMENT)};
constexpr int64_t kSlotsPerRow[] = {EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_PER_ROW)};
constexpr const char* kCombinerNames[] = {EMBARK_ABI_COMBINERS(EMBARK_ABI_NAME)};
constexpr const char* kOptimizerNames[] = {EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_NAME4)};

constexpr int64_t kNumCombiners = sizeof(kCombinerIds) / sizeof(kCombinerIds[0]);
constexpr int64_t kNumOptimizers = sizeof(kOptimizerIds) / sizeof(kOptimizerIds[0]);
constexpr int64_t kNumHparams = sizeof(kHparamIndices) / sizeof(kHparamIndices[0]);

#undef EMBARK_ABI_ENUMERATOR
#undef EMBARK_ABI_ENUMERATOR4
#undef EMBARK_ABI_VALUE
#undef EMBARK_ABI_VALUE4
#undef EMBARK_ABI_PER_ELEMENT
#undef EMBARK_ABI_PER_ROW
#undef EMBARK_ABI_NAME
#undef EMBARK_ABI_NAME4

// The handlers validate an attribute by range, so every list's values must be 0..n-1.
constexpr bool IsDense(const int64_t* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (values[i] != i) return false;
  }
  return true;
}
static_assert(IsDense(kCombinerIds, kNumCombiners), "combiner ids must be 0..n-1 in order");
static_assert(IsDense(kOptimizerIds, kNumOptimizers), "optimizer ids must be 0..n-1 in order");
static_assert(IsDense(kHparamIndices, kNumHparams), "hparam indices must be 0..n-1 in order");

// The kernels take two slot operands (a, b), so no optimizer may need more.
constexpr bool SlotsFit() {
  for (int64_t i = 0; i < kNumOptimizers; ++i) {
    if (kSlotsPerElement[i] + kSlotsPerRow[i] > 2) return false;
  }
  return true;
}
static_assert(SlotsFit(), "an optimizer needs more than the two slot operands");

// float32 elements slot operand `slot` (0 = a, 1 = b) must hold for optimizer id `opt`
// (0 <= opt < kNumOptimizers) on a [vocab, d] table: per-element slots come first, then
// per-row ones (see the list above).
inline int64_t SlotElements(int64_t opt, int slot, int64_t vocab, int64_t d) {
  if (slot < kSlotsPerElement[opt]) return vocab * d;
  if (slot < kSlotsPerElement[opt] + kSlotsPerRow[opt]) return vocab;
  return 0;
}

// The hparams operand unpacked by its layout; the only place that reads it by index.
struct Hparams {
  float lr, eps, b1, b2;
};
EMBARK_HOST_DEVICE inline Hparams LoadHparams(const float* hp) {
  return Hparams{hp[static_cast<int64_t>(Hparam::LR)], hp[static_cast<int64_t>(Hparam::EPS)],
                 hp[static_cast<int64_t>(Hparam::B1)], hp[static_cast<int64_t>(Hparam::B2)]};
}
static_assert(kNumHparams == 4, "update Hparams/LoadHparams with the hparam list");

}  // namespace abi
}  // namespace embark
