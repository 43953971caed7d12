// The kernel ABI of embark_jax: everything Python and the native handlers must agree on, in
// one place. The CPU and CUDA backends include this header; the Python mirror is
// embark_jax/ops/abi.py, and tests/ops/test_abi.py parses the X-macro lists below to check that
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
// use are 0. ROUNDING says how a bfloat16 table's updated elements are stored: 0 = round to
// nearest even, 1 = stochastically, with the random bits of (seed, row, column) (see
// StochasticBf16 below); float32 tables ignore it. The uint32 seed travels as two exact
// float32 integers, SEED_LO = seed & 0xffff and SEED_HI = seed >> 16.
#define EMBARK_ABI_HPARAMS(X) \
  X(LR, 0)                    \
  X(EPS, 1)                   \
  X(B1, 2)                    \
  X(B2, 3)                    \
  X(ROUNDING, 4)              \
  X(SEED_LO, 5)               \
  X(SEED_HI, 6)

// Eviction policy of a dynamic table's hash table (embark_hash_find_or_insert's `eviction`
// attribute): X(NAME, id). What a full bucket does when an admitted newcomer arrives: NONE
// drops the newcomer, LRU replaces the entry seen longest ago, LFU the one seen the fewest
// times (then the one seen longest ago); entries seen in the current step are never replaced,
// remaining ties go to the lowest position (embark_hash_table.h).
#define EMBARK_ABI_EVICTIONS(X) \
  X(NONE, 0)                    \
  X(LRU, 1)                     \
  X(LFU, 2)

// The per-call counts of embark_hash_find_or_insert (its int32 `counts` output): X(NAME,
// index). Every non-padding id is exactly one of FOUND, INSERTED, REFUSED (by admission: seen
// fewer times than the threshold) or DROPPED (admitted, but its bucket had no free slot and
// no entry it could replace); EVICTED and EXPIRED count the inserts that replaced a live
// entry and those that took the slot of an expired one (ttl).
#define EMBARK_ABI_HASH_COUNTS(X) \
  X(FOUND, 0)                     \
  X(INSERTED, 1)                  \
  X(EVICTED, 2)                   \
  X(EXPIRED, 3)                   \
  X(REFUSED, 4)                   \
  X(DROPPED, 5)

// The FFI targets: X(name, HandlerStem). The target is registered as "embark_<name>" on
// every platform; its handlers are the symbols Embark<HandlerStem>Cpu (cpu/) and
// Embark<HandlerStem>Cuda (cuda/), declared from this list by each backend's kernels.h.
#define EMBARK_ABI_TARGETS(X)                 \
  X(segment_sum, SegmentSum)                  \
  X(lookup_pool, LookupPool)                  \
  X(unique, Unique)                           \
  X(sparse_grad, SparseGrad)                  \
  X(sparse_update, SparseUpdate)              \
  X(sparse_grad_update, SparseGradUpdate)     \
  X(sparse_grad_stage, SparseGradStage)       \
  X(commit_rows, CommitRows)                  \
  X(hash_find, HashFind)                      \
  X(hash_find_or_insert, HashFindOrInsert)

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
enum class Eviction : int64_t { EMBARK_ABI_EVICTIONS(EMBARK_ABI_ENUMERATOR) };
enum class HashCount : int64_t { EMBARK_ABI_HASH_COUNTS(EMBARK_ABI_ENUMERATOR) };

constexpr int64_t kCombinerIds[] = {EMBARK_ABI_COMBINERS(EMBARK_ABI_VALUE)};
constexpr int64_t kOptimizerIds[] = {EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_VALUE4)};
constexpr int64_t kHparamIndices[] = {EMBARK_ABI_HPARAMS(EMBARK_ABI_VALUE)};
constexpr int64_t kSlotsPerElement[] = {EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_PER_ELEMENT)};
constexpr int64_t kSlotsPerRow[] = {EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_PER_ROW)};
constexpr const char* kCombinerNames[] = {EMBARK_ABI_COMBINERS(EMBARK_ABI_NAME)};
constexpr const char* kOptimizerNames[] = {EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_NAME4)};
constexpr int64_t kEvictionIds[] = {EMBARK_ABI_EVICTIONS(EMBARK_ABI_VALUE)};
constexpr const char* kEvictionNames[] = {EMBARK_ABI_EVICTIONS(EMBARK_ABI_NAME)};
constexpr int64_t kHashCountIndices[] = {EMBARK_ABI_HASH_COUNTS(EMBARK_ABI_VALUE)};

constexpr int64_t kNumCombiners = sizeof(kCombinerIds) / sizeof(kCombinerIds[0]);
constexpr int64_t kNumOptimizers = sizeof(kOptimizerIds) / sizeof(kOptimizerIds[0]);
constexpr int64_t kNumHparams = sizeof(kHparamIndices) / sizeof(kHparamIndices[0]);
constexpr int64_t kNumEvictions = sizeof(kEvictionIds) / sizeof(kEvictionIds[0]);
constexpr int64_t kNumHashCounts = sizeof(kHashCountIndices) / sizeof(kHashCountIndices[0]);

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
static_assert(IsDense(kEvictionIds, kNumEvictions), "eviction ids must be 0..n-1 in order");
static_assert(IsDense(kHashCountIndices, kNumHashCounts), "hash counts must be 0..n-1 in order");

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

// The footprint of optimizer id `opt` as switch statements generated from the list, so that
// device code (which cannot index the host arrays above) reads the same numbers.
#define EMBARK_ABI_CASE_PER_ELEMENT(name, value, per_element, per_row) \
  case value:                                                         \
    return per_element;
#define EMBARK_ABI_CASE_PER_ROW(name, value, per_element, per_row) \
  case value:                                                     \
    return per_row;
EMBARK_HOST_DEVICE constexpr int64_t SlotsPerElement(int64_t opt) {
  switch (opt) {
    EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_CASE_PER_ELEMENT)
    default:
      return 0;
  }
}
EMBARK_HOST_DEVICE constexpr int64_t SlotsPerRow(int64_t opt) {
  switch (opt) {
    EMBARK_ABI_OPTIMIZERS(EMBARK_ABI_CASE_PER_ROW)
    default:
      return 0;
  }
}
#undef EMBARK_ABI_CASE_PER_ELEMENT
#undef EMBARK_ABI_CASE_PER_ROW

// float32 elements a row of the table has in slot operand `slot` (0 = a, 1 = b) of
// optimizer id `opt`: d for a per-element slot, 1 for a per-row one, 0 for none. A staged
// update (sparse_grad_stage) writes rows of these widths.
EMBARK_HOST_DEVICE constexpr int64_t SlotRowWidth(int64_t opt, int slot, int64_t d) {
  return slot < SlotsPerElement(opt)                      ? d
         : slot < SlotsPerElement(opt) + SlotsPerRow(opt) ? 1
                                                           : 0;
}

// The hparams operand unpacked by its layout; the only place that reads it by index.
struct Hparams {
  float lr, eps, b1, b2;
  bool stochastic;  // ROUNDING == 1: bfloat16 tables round stochastically
  uint32_t seed;    // the rounding seed (SEED_HI << 16 | SEED_LO)
};
// A 16-bit half of the seed (anything but an integer in [0, 65536) reads as 0).
EMBARK_HOST_DEVICE inline uint32_t SeedHalf(float v) {
  return (v >= 0.0f && v < 65536.0f) ? static_cast<uint32_t>(v) : 0u;
}
EMBARK_HOST_DEVICE inline Hparams LoadHparams(const float* hp) {
  const uint32_t lo = SeedHalf(hp[static_cast<int64_t>(Hparam::SEED_LO)]);
  const uint32_t hi = SeedHalf(hp[static_cast<int64_t>(Hparam::SEED_HI)]);
  return Hparams{hp[static_cast<int64_t>(Hparam::LR)],
                 hp[static_cast<int64_t>(Hparam::EPS)],
                 hp[static_cast<int64_t>(Hparam::B1)],
                 hp[static_cast<int64_t>(Hparam::B2)],
                 hp[static_cast<int64_t>(Hparam::ROUNDING)] != 0.0f,
                 (hi << 16) | lo};
}
static_assert(kNumHparams == 7, "update Hparams/LoadHparams with the hparam list");

// Stochastic rounding of bfloat16 table writes (ROUNDING == 1), as FBGEMM's
// stochastic_rounding: a float32 value is stored as the bfloat16 just below or just above it
// (in magnitude), the upper one with probability equal to the fraction of the bfloat16 step
// it lies above the lower one, so the stored value is unbiased: E[stored] = value. The
// random bits come from a counter-based hash of (seed, row, column), so a result depends on
// the seed and the element only, never on threads, warps or the order of the rows. Mirrored
// bit for bit by embark_jax/ops/reference.py (`stochastic_round_bf16`).

// A 32-bit integer hash (Wellons' "lowbias32"): a bijection with full avalanche.
EMBARK_HOST_DEVICE inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The per-row part of the hash (computed once per row of the buffer the kernel updates).
EMBARK_HOST_DEVICE inline uint32_t RowKey(uint32_t seed, int64_t row) {
  const uint64_t r = static_cast<uint64_t>(row);
  uint32_t h = Mix32(seed ^ 0x9e3779b9u);
  h = Mix32(h ^ static_cast<uint32_t>(r));
  return Mix32(h ^ static_cast<uint32_t>(r >> 32));
}

// 32 random bits for column `col` of the row whose key is `row_key`.
EMBARK_HOST_DEVICE inline uint32_t ElementBits(uint32_t row_key, int64_t col) {
  return Mix32(row_key ^ static_cast<uint32_t>(col));
}

// The bfloat16 bits of the float32 with bits `f32_bits`, rounded stochastically with
// `random`: its upper 16 bits are added below the bfloat16 mantissa, then the low 16 bits
// are dropped. Infinities stay infinite, values just below the largest bfloat16 may round
// to infinity as with round to nearest, NaN stays a (quiet) NaN.
EMBARK_HOST_DEVICE inline uint16_t StochasticBf16(uint32_t f32_bits, uint32_t random) {
  if ((f32_bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((f32_bits >> 16) | 0x40u);
  }
  return static_cast<uint16_t>((f32_bits + (random >> 16)) >> 16);
}

// The hash of a dynamic table's 64-bit id (lo, hi words): a bijective 64-bit mixer from 32-bit
// operations only, so that CUDA, C++ and jnp without 64-bit types agree bit for bit (mirrored
// by embark_jax/core/dynamic.py `hash_words` and embark_jax/ops/hash_reference.py). A 4-round
// Feistel network whose round function is Mix32: (l, r) <- (r, l ^ Mix32(r ^ key_i)),
// starting from (lo, hi). Word 0 of the result picks the bucket (h0 % buckets); word 1 is
// reserved for routing ids to shards, so the bucket inside a shard is independent of it.
#define EMBARK_ABI_HASH_ROUND_KEYS(X) \
  X(0, 0x9e3779b9u)                   \
  X(1, 0x7f4a7c15u)                   \
  X(2, 0xf39cc060u)                   \
  X(3, 0x5ced1b1bu)

EMBARK_HOST_DEVICE inline void HashKey(uint32_t lo, uint32_t hi, uint32_t* h0, uint32_t* h1) {
  uint32_t l = lo, r = hi, t;
#define EMBARK_ABI_HASH_ROUND(i, key) \
  t = l ^ Mix32(r ^ key);             \
  l = r;                              \
  r = t;
  EMBARK_ABI_HASH_ROUND_KEYS(EMBARK_ABI_HASH_ROUND)
#undef EMBARK_ABI_HASH_ROUND
  *h0 = l;
  *h1 = r;
}

}  // namespace abi
}  // namespace embark
