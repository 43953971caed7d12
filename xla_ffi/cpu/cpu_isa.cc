// CPU feature detection for the SIMD dispatch (cpu_isa.h).
#include "cpu_isa.h"

#include <atomic>

namespace embark {
namespace {

CpuIsa Detect() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // libgcc's checks include the OS's XSAVE state (XCR0), not only the CPUID bits.
  if (__builtin_cpu_supports("avx512f")) {
    const bool bf16 =
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
    return bf16 ? CpuIsa::AVX512_BF16 : CpuIsa::AVX512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::AVX2;
#endif
  return CpuIsa::SCALAR;
}

std::atomic<int> g_active{-1};

}  // namespace

CpuIsa BestCpuIsa() {
  static const CpuIsa best = Detect();
  return best;
}

CpuIsa ActiveCpuIsa() {
  int v = g_active.load(std::memory_order_relaxed);
  return v < 0 ? BestCpuIsa() : static_cast<CpuIsa>(v);
}

bool SetCpuIsa(CpuIsa isa) {
  if (static_cast<int>(isa) > static_cast<int>(BestCpuIsa())) return false;
  g_active.store(static_cast<int>(isa), std::memory_order_relaxed);
  return true;
}

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::AVX512_BF16: return "avx512bf16";
    case CpuIsa::AVX512: return "avx512";
    case CpuIsa::AVX2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace embark
