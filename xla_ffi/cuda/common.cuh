// Shared device helpers for the embark_jax CUDA kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "embark_check.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"

namespace embark {

// How the CUDA kernels store a bfloat16 (the Bf16 argument of DispatchFloat on CUDA).
using DevBf16 = __nv_bfloat16;

template <typename T>
struct DevElem;
template <>
struct DevElem<float> {
  static __device__ __forceinline__ float Load(const float* p, int64_t i) { return p[i]; }
  static __device__ __forceinline__ void Store(float* p, int64_t i, float v) { p[i] = v; }
  static __device__ __forceinline__ void AtomicAdd(float* p, int64_t i, float v) {
    atomicAdd(p + i, v);
  }
};
template <>
struct DevElem<__nv_bfloat16> {
  static __device__ __forceinline__ float Load(const __nv_bfloat16* p, int64_t i) {
    return __bfloat162float(p[i]);
  }
  static __device__ __forceinline__ void Store(__nv_bfloat16* p, int64_t i, float v) {
    p[i] = __float2bfloat16(v);
  }
  static __device__ __forceinline__ void AtomicAdd(__nv_bfloat16* p, int64_t i, float v) {
    atomicAdd(p + i, __float2bfloat16(v));
  }
};

template <typename I>
__device__ __forceinline__ int64_t DevLoadId(const I* ids, int64_t i) {
  return static_cast<int64_t>(ids[i]);
}

// Element i of an int32 or int64 id buffer (a warp-uniform branch).
__device__ __forceinline__ int64_t DevLoadIdAny(const void* ids, bool ids64, int64_t i) {
  return ids64 ? static_cast<const int64_t*>(ids)[i]
               : static_cast<int64_t>(static_cast<const int32_t*>(ids)[i]);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

inline unsigned GridFor(int64_t work_items, int per_block) {
  int64_t b = (work_items + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

// Copies src to dst on the stream unless XLA aliased them (input_output_aliases).
inline void CopyIfNotAliasedAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (dst != src) cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

inline ffi::Error CudaStatus(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("embark_jax CUDA ") + what + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace embark
