// SIMD vectors for the CPU kernels' hot loops, one per instruction set of cpu_isa.h.
//
// A kernel writes its loop once against `Vec` (kW floats per vector, up to kMaxNV vectors of
// accumulators held in registers) in an .inc file, and includes that file three times: in a
// namespace whose `Vec` is ScalarVec, and inside `#pragma GCC target` regions with Avx2Vec and
// Avx512Vec (lookup_pool a fourth time, for its bfloat16 outputs, with Avx512Bf16Vec).
// Everything defined in a region is compiled for its
// instruction set; the rest of the module stays baseline x86-64, so it loads on any CPU and
// only the path ActiveCpuIsa() picks ever runs. Row loads take float32 or bfloat16 (stored as
// uint16, widened to float32 exactly by a 16-bit shift).
#pragma once

#include <cstdint>

#include "host_bf16.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EMBARK_HAVE_X86_SIMD 1
#else
#define EMBARK_HAVE_X86_SIMD 0
#endif

// Forces inlining in the hot loops (the compiler declines for large unrolled bodies).
#define EMBARK_INLINE inline __attribute__((always_inline))

namespace embark {

// Portable C++ (the compiler may still vectorise it for the baseline instruction set).
struct ScalarVec {
  static constexpr int64_t kW = 1, kMaxNV = 16;
  using V = float;
  static inline V Zero() { return 0.0f; }
  static inline V Set1(float x) { return x; }
  static inline V Load(const float* p) { return *p; }
  static inline V Load(const uint16_t* p) { return Bf16ToFloat(*p); }
  static inline V Fma(V a, V b, V c) { return a * b + c; }
  static inline V Add(V a, V b) { return a + b; }
  static inline V Mul(V a, V b) { return a * b; }
  static inline void Store(float* p, V v) { *p = v; }
  static inline void StoreBf16(uint16_t* p, V v) { *p = FloatToBf16(v); }  // host_bf16.h
  // The pair forms of Avx2Vec/Avx512Vec (the pooling loop uses them only with wider vectors).
  static inline void LoadBf16Pair(const uint16_t* p, V* even, V* odd) {
    *even = Bf16ToFloat(p[0]);
    *odd = Bf16ToFloat(p[1]);
  }
  static inline void StorePair(float* p, V even, V odd) {
    p[0] = even;
    p[1] = odd;
  }
  static inline void StoreBf16Pair(uint16_t* p, V even, V odd) {
    p[0] = FloatToBf16(even);
    p[1] = FloatToBf16(odd);
  }
};

#if EMBARK_HAVE_X86_SIMD

#pragma GCC push_options
#pragma GCC target("avx2,fma")
struct Avx2Vec {
  static constexpr int64_t kW = 8, kMaxNV = 8;
  using V = __m256;
  static inline V Zero() { return _mm256_setzero_ps(); }
  static inline V Set1(float x) { return _mm256_set1_ps(x); }
  static inline V Load(const float* p) { return _mm256_loadu_ps(p); }
  static inline V Load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // Two vectors from 2 * kW bfloat16 values in one load, each widened by a shift or a mask:
  // `even` holds the values at even positions, `odd` those at odd positions. A row summed in
  // this order is stored back in order by StorePair / StoreBf16Pair.
  static inline void LoadBf16Pair(const uint16_t* p, V* even, V* odd) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536)));
  }
  static inline void StorePair(float* p, V even, V odd) {  // p[2i] = even[i], p[2i+1] = odd[i]
    const __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(p + kW, _mm256_permute2f128_ps(a, b, 0x31));
  }
  static inline void StoreBf16Pair(uint16_t* p, V even, V odd) {  // StorePair, rounded
    const __m256i r = _mm256_or_si256(RoundBf16(even), _mm256_slli_epi32(RoundBf16(odd), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), r);
  }
  static inline void StoreBf16(uint16_t* p, V v) {  // FloatToBf16, 8 at a time
    const __m256i r = RoundBf16(v);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  // FloatToBf16 of each lane, in the lane's low 16 bits (the high 16 bits zero).
  static inline __m256i RoundBf16(V v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i hi = _mm256_srli_epi32(bits, 16);
    const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));  // mag >= 0
    const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);  // each lane <= 0xffff
  }
};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
struct Avx512Vec {
  static constexpr int64_t kW = 16, kMaxNV = 8;
  using V = __m512;
  static inline V Zero() { return _mm512_setzero_ps(); }
  static inline V Set1(float x) { return _mm512_set1_ps(x); }
  static inline V Load(const float* p) { return _mm512_loadu_ps(p); }
  static inline V Load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  // As Avx2Vec's: `even` and `odd` from 2 * kW bfloat16 values in one load.
  static inline void LoadBf16Pair(const uint16_t* p, V* even, V* odd) {
    const __m512i x = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(-65536)));
  }
  static inline void StorePair(float* p, V even, V odd) {  // p[2i] = even[i], p[2i+1] = odd[i]
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi =
        _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    _mm512_storeu_ps(p, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps(p + kW, _mm512_permutex2var_ps(even, hi, odd));
  }
  static inline void StoreBf16Pair(uint16_t* p, V even, V odd) {  // StorePair, rounded
    const __m512i r = _mm512_or_si512(RoundBf16(even), _mm512_slli_epi32(RoundBf16(odd), 16));
    _mm512_storeu_si512(p, r);
  }
  static inline void StoreBf16(uint16_t* p, V v) {  // FloatToBf16, 16 at a time
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(RoundBf16(v)));
  }
  // FloatToBf16 of each lane, in the lane's low 16 bits (the high 16 bits zero).
  static inline __m512i RoundBf16(V v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i hi = _mm512_srli_epi32(bits, 16);
    const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    return _mm512_mask_blend_epi32(nan, rounded, quiet);  // each lane <= 0xffff
  }
};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma")
// Avx512Vec whose bfloat16 stores use the BF16 extension: VCVTNE2PS2BF16 rounds 32 floats to
// nearest even (NaN quieted: the same bits as RoundBf16) in one instruction where RoundBf16
// takes eight per 16, so a short bag's bf16 store costs 4 instructions instead of ~40 (for
// short bags the store, on the ports that run 512-bit instructions, is the bound). It also
// rounds a subnormal float to a signed zero, where RoundBf16 keeps it; the kernels run in
// XLA's floating-point mode, which flushes subnormal sums to zero, so no sum they round is
// subnormal and every path stores the same bits.
struct Avx512Bf16Vec : Avx512Vec {
  static inline void StoreBf16Pair(uint16_t* p, V even, V odd) {  // StorePair, rounded
    // Words 0-15: even[0..15], 16-31: odd[0..15]; the permute interleaves them.
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(order, both));
  }
  static inline void StoreBf16(uint16_t* p, V v) {  // FloatToBf16, 16 at a time
    const __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), r);
  }
};
#pragma GCC pop_options

#endif  // EMBARK_HAVE_X86_SIMD

}  // namespace embark
