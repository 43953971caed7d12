// bfloat16 <-> float on the host: a bf16 is the upper 16 bits of an IEEE float. The one place
// for the rounding rule; embark_ffi.h (Elem<uint16_t>) and cpu_simd.h (ScalarVec) use it, and
// the AVX2/AVX-512 StoreBf16 of cpu_simd.h compute the same bits a vector at a time.
#pragma once

#include <cstdint>
#include <cstring>

namespace embark {

inline float Bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even; a NaN stays a (quiet) NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

}  // namespace embark
