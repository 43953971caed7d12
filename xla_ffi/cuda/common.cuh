// Shared device helpers for the embark_jax CUDA kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "embark_check.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"

namespace embark {

// Every piece of a kernel's workspace starts on a 256-byte boundary (as cudaMalloc's do).
inline size_t Align256(size_t x) { return (x + 255) & ~size_t{255}; }

// Lays out the pieces of one workspace one after another: Take(bytes) is the next piece's
// offset; `total` the bytes taken so far.
struct WorkspacePieces {
  size_t total = 0;
  size_t Take(size_t bytes) {
    const size_t at = total;
    total += Align256(bytes);
    return at;
  }
};

// How the CUDA kernels store a bfloat16 (the Bf16 argument of DispatchFloat on CUDA).
using DevBf16 = __nv_bfloat16;

template <typename T>
struct DevElem;
template <>
struct DevElem<float> {
  static __device__ __forceinline__ float Load(const float* p, int64_t i) { return p[i]; }
  static __device__ __forceinline__ void Store(float* p, int64_t i, float v) { p[i] = v; }
};
template <>
struct DevElem<__nv_bfloat16> {
  static __device__ __forceinline__ float Load(const __nv_bfloat16* p, int64_t i) {
    return __bfloat162float(p[i]);
  }
  static __device__ __forceinline__ void Store(__nv_bfloat16* p, int64_t i, float v) {
    p[i] = __float2bfloat16(v);
  }
};
// Sums are accumulated in float32 (registers, or a float32 workspace with atomics) and
// rounded to the output dtype once, as on the CPU: there is deliberately no bfloat16 atomic
// add here (rounding after every add loses the sum, e.g. 1000 ones give 256).

// Converts a float32 accumulator to the output dtype (the last pass of atomic reductions).
// With `only_if` non-null, does nothing unless *only_if != 0 (a device-side decision).
template <typename O>
__global__ void ConvertKernel(const float* acc, int64_t count, O* out, const int32_t* only_if) {
  if (only_if != nullptr && *only_if == 0) return;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    DevElem<O>::Store(out, e, acc[e]);
  }
}

template <typename I>
__device__ __forceinline__ int64_t DevLoadId(const I* ids, int64_t i) {
  return static_cast<int64_t>(ids[i]);
}

// Element i of an int32 or int64 id buffer (a warp-uniform branch).
__device__ __forceinline__ int64_t DevLoadIdAny(const void* ids, bool ids64, int64_t i) {
  return ids64 ? static_cast<const int64_t*>(ids)[i]
               : static_cast<int64_t>(static_cast<const int32_t*>(ids)[i]);
}

// Warp-per-item loops (a warp per row, bag or id): this thread's warp's index in the grid
// is the first item, and the grid's warp count the stride:
//   for (int64_t k = GridWarp(); k < n; k += GridWarps()) { ... }
__device__ __forceinline__ int64_t GridWarp() {
  return blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5);
}
__device__ __forceinline__ int64_t GridWarps() {
  return static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

inline unsigned GridFor(int64_t work_items, int per_block) {
  int64_t b = (work_items + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

inline ffi::Error CudaError(const char* what, const char* call, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("embark_jax CUDA ") + what + ": " +
                                                   call + ": " + cudaGetErrorString(err));
}

// The status of the launches so far (cudaGetLastError), as an FFI error.
inline ffi::Error CudaStatus(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError(what, "kernel launch", err);
  return ffi::Error::Success();
}

// Evaluates a CUDA/CUB call returning cudaError_t; returns an FFI error from the handler if
// it failed.
#define EMBARK_CUDA_RETURN_IF_ERROR(what, call)                  \
  do {                                                           \
    cudaError_t embark_err_ = (call);                            \
    if (embark_err_ != cudaSuccess) {                            \
      return ::embark::CudaError(what, #call, embark_err_);      \
    }                                                            \
  } while (0)

// Copies src to dst on the stream unless XLA aliased them (input_output_aliases).
inline cudaError_t CopyIfNotAliasedAsync(void* dst, const void* src, size_t bytes,
                                         cudaStream_t stream) {
  if (dst == src || bytes == 0) return cudaSuccess;
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

// An output that starts as its input (an in-place update): see StartFromInputs.
struct InOut {
  void* out;
  const void* in;
  size_t bytes;
};
template <typename Out, typename In>
InOut Same(const Out& out, const In& in) {
  return {out.untyped_data(), in.untyped_data(), in.size_bytes()};
}
template <typename Out, typename In>
InOut Same(ffi::Result<Out>& out, const In& in) {
  return Same(*out, in);
}

// Each output of an in-place handler starts as its input: XLA aliases them
// (input_output_aliases), and where it did not, the input is copied on the stream first.
inline ffi::Error StartFromInputs(const char* what, cudaStream_t stream,
                                  std::initializer_list<InOut> pairs) {
  for (const InOut& p : pairs) {
    EMBARK_CUDA_RETURN_IF_ERROR(what, CopyIfNotAliasedAsync(p.out, p.in, p.bytes, stream));
  }
  return ffi::Error::Success();
}

}  // namespace embark
