// Run-time choice of the SIMD instruction set for the CPU kernels' hot loops.
//
// The module is compiled for baseline x86-64 (so a wheel built on one machine runs on any
// other); the hot loops are compiled once per instruction set (AVX-512, AVX2 + FMA, portable
// C++; lookup_pool's bfloat16 outputs once more for AVX-512 with the BF16 conversions) and the
// kernel picks one at each call: the best the CPU and OS support, unless
// narrowed by SetCpuIsa (Python: embark_jax.ops.native.set_cpu_isa, or the EMBARK_CPU_ISA
// environment variable read at registration). Tests use the override to check every path
// against the jnp reference on one machine.
#pragma once

#include <cstdint>

namespace embark {

// Each level includes the ones below it. AVX512_BF16: AVX-512 (F, BW) plus the BF16
// extension's float -> bfloat16 conversions (VCVTNE2PS2BF16), which lookup_pool's bfloat16
// outputs use; every other loop runs its AVX-512 copy there.
enum class CpuIsa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3 };

// The best instruction set this CPU and OS support.
CpuIsa BestCpuIsa();
// The instruction set the kernels use now: BestCpuIsa() unless narrowed by SetCpuIsa.
CpuIsa ActiveCpuIsa();
// Uses `isa` from the next kernel call on; false (and nothing changes) if unsupported here.
bool SetCpuIsa(CpuIsa isa);
const char* CpuIsaName(CpuIsa isa);

}  // namespace embark
