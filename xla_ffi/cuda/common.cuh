// Shared device helpers for the embark_jax CUDA kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "embark_ffi.h"

namespace embark {

template <typename T>
struct DevElem;
template <>
struct DevElem<float> {
  static __device__ __forceinline__ float Load(const float* p, int64_t i) { return __ldg(p + i); }
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

inline ffi::Error CudaStatus(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("embark_jax CUDA ") + what + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace embark
