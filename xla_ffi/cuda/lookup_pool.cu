// Fused gather + weighted pooling on CUDA.
//
// Sorted segment ids (the SparseFeatures layout; the caller says so with indices_are_sorted):
// one warp per bag finds its ids by binary search, accumulates in registers and writes the
// pooled row once; float32 tables with D % 4 == 0 use float4 loads. Unsorted segment ids: a
// warp per id adds its scaled row into a float32 accumulator in the workspace with atomics,
// then a pass converts to the output dtype. `none`: a warp per id copies w * row.
// Workspace (an extra output sized by Python): [S] float32 denominators (+ [S, D] float32
// accumulators when unsorted). No allocation, no host sync.
#include "common.cuh"
#include "embark_abi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

using abi::Combiner;

struct Args {
  const void* ids;
  bool ids64;
  const void* seg;
  bool seg64;
  const float* w;
  int64_t n, vocab, d, num_segments;
  Combiner combiner;
};

__device__ __forceinline__ int64_t ValidId(const Args& a, int64_t i) {
  int64_t x = DevLoadIdAny(a.ids, a.ids64, i);
  return (x >= 0 && x < a.vocab) ? x : -1;
}

__device__ __forceinline__ int64_t LowerBound(const Args& a, int64_t value) {
  int64_t lo = 0, hi = a.n;
  while (lo < hi) {
    int64_t mid = (lo + hi) >> 1;
    if (DevLoadIdAny(a.seg, a.seg64, mid) < value) lo = mid + 1; else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ float ScaleFor(Combiner combiner, float denom) {
  if (combiner == Combiner::MEAN) return denom > 0.0f ? 1.0f / denom : 0.0f;
  if (combiner == Combiner::SQRTN) return denom > 0.0f ? rsqrtf(denom) : 0.0f;
  return 1.0f;
}

template <typename T>
__device__ __forceinline__ float4 Load4(const T* p, int64_t e);
template <>
__device__ __forceinline__ float4 Load4<float>(const float* p, int64_t e) {
  return __ldg(reinterpret_cast<const float4*>(p + e));
}
template <>
__device__ __forceinline__ float4 Load4<__nv_bfloat16>(const __nv_bfloat16* p, int64_t e) {
  const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(p + e);
  float2 a = __bfloat1622float2(q[0]);
  float2 b = __bfloat1622float2(q[1]);
  return make_float4(a.x, a.y, b.x, b.y);
}

// One warp per bag. VEC: each lane handles 4 consecutive columns per 128-column chunk.
template <typename T, typename O, bool VEC>
__global__ void PoolSortedKernel(const T* __restrict__ table, Args a, O* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5);
       s < a.num_segments; s += warps) {
    const int64_t lo = LowerBound(a, s), hi = LowerBound(a, s + 1);
    float part = 0.0f;
    for (int64_t i = lo + lane; i < hi; i += 32) {
      if (ValidId(a, i) >= 0) part += a.combiner == Combiner::SQRTN ? a.w[i] * a.w[i] : a.w[i];
    }
    const float scale = ScaleFor(a.combiner, WarpSum(part));
    if (VEC) {
      for (int64_t c0 = 0; c0 < a.d; c0 += 128) {
        const int64_t j = c0 + 4 * lane;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t id = ValidId(a, i);
          if (id < 0 || j >= a.d) continue;
          const float wi = a.w[i];
          float4 r = Load4<T>(table, id * a.d + j);
          acc.x += wi * r.x; acc.y += wi * r.y; acc.z += wi * r.z; acc.w += wi * r.w;
        }
        if (j < a.d) {
          O* o = out + s * a.d + j;
          DevElem<O>::Store(o, 0, acc.x * scale);
          DevElem<O>::Store(o, 1, acc.y * scale);
          DevElem<O>::Store(o, 2, acc.z * scale);
          DevElem<O>::Store(o, 3, acc.w * scale);
        }
      }
    } else {
      for (int64_t j = lane; j < a.d; j += 32) {
        float acc = 0.0f;
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t id = ValidId(a, i);
          if (id >= 0) acc += a.w[i] * DevElem<T>::Load(table, id * a.d + j);
        }
        DevElem<O>::Store(out, s * a.d + j, acc * scale);
      }
    }
  }
}

__global__ void DenomKernel(Args a, float* denom) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < a.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = DevLoadIdAny(a.seg, a.seg64, i);
    if (s < 0 || s >= a.num_segments || ValidId(a, i) < 0) continue;
    atomicAdd(denom + s, a.combiner == Combiner::SQRTN ? a.w[i] * a.w[i] : a.w[i]);
  }
}

template <typename T>
__global__ void PoolAtomicKernel(const T* __restrict__ table, Args a, const float* denom,
                                 float* acc) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5);
       i < a.n; i += warps) {
    const int64_t s = DevLoadIdAny(a.seg, a.seg64, i);
    const int64_t id = ValidId(a, i);
    if (s < 0 || s >= a.num_segments || id < 0) continue;
    const float c = a.w[i] * ScaleFor(a.combiner, denom[s]);
    for (int64_t j = lane; j < a.d; j += 32) {
      atomicAdd(acc + s * a.d + j, c * DevElem<T>::Load(table, id * a.d + j));
    }
  }
}

template <typename O>
__global__ void ConvertKernel(const float* acc, int64_t count, O* out) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    DevElem<O>::Store(out, e, acc[e]);
  }
}

template <typename T, typename O>
__global__ void GatherRowsKernel(const T* __restrict__ table, Args a, O* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5);
       i < a.n; i += warps) {
    const int64_t id = ValidId(a, i);
    const float wi = id >= 0 ? a.w[i] : 0.0f;
    for (int64_t j = lane; j < a.d; j += 32) {
      DevElem<O>::Store(out, i * a.d + j, id >= 0 ? wi * DevElem<T>::Load(table, id * a.d + j) : 0.0f);
    }
  }
}

template <typename T, typename O>
ffi::Error Launch(cudaStream_t stream, const void* table, Args a, bool sorted, void* out,
                  void* workspace, size_t workspace_bytes) {
  const int threads = 256, warps_per_block = threads / 32;
  const T* t = static_cast<const T*>(table);
  O* o = static_cast<O*>(out);
  if (a.combiner == Combiner::NONE) {
    GatherRowsKernel<T, O><<<GridFor(a.n, warps_per_block), threads, 0, stream>>>(t, a, o);
  } else if (sorted) {
    const bool vec = a.d % 4 == 0;
    if (vec) {
      PoolSortedKernel<T, O, true><<<GridFor(a.num_segments, warps_per_block), threads, 0, stream>>>(t, a, o);
    } else {
      PoolSortedKernel<T, O, false><<<GridFor(a.num_segments, warps_per_block), threads, 0, stream>>>(t, a, o);
    }
  } else {
    const size_t need = sizeof(float) * (a.num_segments + a.num_segments * a.d);
    if (workspace_bytes < need) {
      return InvalidArgument("lookup_pool: workspace must have at least " + std::to_string(need) +
                             " bytes (float32 [S] denominators and [S, D] accumulators for "
                             "unsorted segment ids), got " + std::to_string(workspace_bytes));
    }
    float* denom = static_cast<float*>(workspace);
    float* acc = denom + a.num_segments;
    cudaMemsetAsync(workspace, 0, need, stream);
    if (a.combiner != Combiner::SUM) {
      DenomKernel<<<GridFor(a.n, threads), threads, 0, stream>>>(a, denom);
    }
    PoolAtomicKernel<T><<<GridFor(a.n, warps_per_block), threads, 0, stream>>>(t, a, denom, acc);
    ConvertKernel<O><<<GridFor(a.num_segments * a.d, threads), threads, 0, stream>>>(
        acc, a.num_segments * a.d, o);
  }
  return CudaStatus("lookup_pool");
}

ffi::Error LookupPoolCudaImpl(cudaStream_t stream, ffi::AnyBuffer table, ffi::AnyBuffer ids,
                              ffi::AnyBuffer seg, ffi::AnyBuffer weights,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace, int64_t combiner,
                              int64_t indices_are_sorted) {
  ffi::Error err = CheckLookupPool(table, ids, seg, weights, *out, combiner);
  if (err.failure()) return err;
  const int64_t n = static_cast<int64_t>(ids.element_count());
  Args a{ids.untyped_data(),
         ids.element_type() == ffi::DataType::S64,
         seg.untyped_data(),
         seg.element_type() == ffi::DataType::S64,
         static_cast<const float*>(weights.untyped_data()),
         n,
         table.dimensions()[0],
         table.dimensions()[1],
         out->dimensions()[0],
         static_cast<Combiner>(combiner)};
  const bool sorted = indices_are_sorted != 0;
  return DispatchFloat<DevBf16>("lookup_pool", "table", table.element_type(), [&](auto t) {
    return DispatchFloat<DevBf16>("lookup_pool", "output", out->element_type(), [&](auto o) {
      return Launch<EMBARK_TYPE(t), EMBARK_TYPE(o)>(stream, table.untyped_data(), a, sorted,
                                                    out->untyped_data(), workspace->untyped_data(),
                                                    workspace->size_bytes());
    });
  });
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkLookupPoolCuda, embark::LookupPoolCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("combiner")
                                  .Attr<int64_t>("indices_are_sorted"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
