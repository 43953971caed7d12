// Fused gather + weighted pooling on CUDA.
//
// Pooled combiners (sum/mean/sqrtn) take one of two paths, with one result:
//
// - indices_are_sorted=1 (the SparseFeatures layout): a pass over the segment ids builds the
//   bag offsets [S + 1] and checks the order. Then one warp per bag: each lane preloads an id
//   and its weight, the warp shares them by shuffles, and 32 / LPR groups of LPR lanes gather
//   that many rows at a time (LPR = 8 or 16 for small D: several rows in flight per warp),
//   accumulate in float32 registers, reduce across groups and write the pooled row once.
//   float32/bfloat16 tables with D % 4 == 0 load 4 columns per lane.
// - Otherwise, or when the check found the ids out of order (the flag is read on the device,
//   so no host sync): a warp per id adds its scaled row into float32 accumulators in the
//   workspace with atomics, then a pass converts to the output dtype.
//
// So indices_are_sorted is a hint on both backends (the CPU kernel checks the order too):
// unsorted ids with the flag set give the right bags, only more slowly.
// `none`: a warp per id copies w * row.
// Workspace (an extra output sized by Python with _ffi_cuda.lookup_pool_workspace_bytes):
// the order flag, the offsets, [S] float32 denominators and [S, D] float32 accumulators.
// No allocation, no host sync.
#include <string>
#include <vector>

#include "common.cuh"
#include "embark_abi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {

namespace {
// Byte offsets of the workspace parts for num_out bags of width d.
struct PoolLayout {
  size_t flag, offsets, denom, acc, total;
};
PoolLayout MakePoolLayout(int64_t num_out, int64_t d) {
  const size_t s = static_cast<size_t>(num_out < 0 ? 0 : num_out);
  PoolLayout L{};
  L.flag = 0;
  L.offsets = Align256(sizeof(int32_t));
  L.denom = L.offsets + Align256(sizeof(int64_t) * (s + 1));
  L.acc = L.denom + Align256(sizeof(float) * s);
  L.total = L.acc + sizeof(float) * s * static_cast<size_t>(d);
  return L;
}
}  // namespace

size_t LookupPoolWorkspaceBytes(int64_t num_out, int64_t d, int64_t combiner) {
  if (combiner == static_cast<int64_t>(abi::Combiner::NONE)) return 1;
  return MakePoolLayout(num_out, d).total;
}

namespace {

using abi::Combiner;
constexpr unsigned kFull = 0xffffffffu;

struct Args {
  const void* ids;
  bool ids64;
  const void* seg;
  bool seg64;
  const float* w;  // [N], or null: every weight is 1
  int64_t n, vocab, d, num_segments;
  Combiner combiner;
};

__device__ __forceinline__ float WeightAt(const Args& a, int64_t i) {
  return a.w != nullptr ? a.w[i] : 1.0f;
}

__device__ __forceinline__ int64_t ValidId(const Args& a, int64_t i) {
  int64_t x = DevLoadIdAny(a.ids, a.ids64, i);
  return (x >= 0 && x < a.vocab) ? x : -1;
}

__device__ __forceinline__ float ScaleFor(Combiner combiner, float denom) {
  if (combiner == Combiner::MEAN) return denom > 0.0f ? 1.0f / denom : 0.0f;
  if (combiner == Combiner::SQRTN) return denom > 0.0f ? rsqrtf(denom) : 0.0f;
  return 1.0f;
}

__device__ __forceinline__ int64_t Clamp(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// offsets[t] = the first position whose segment id is >= t (t = 0..S), assuming the ids are
// sorted; sets *unsorted when some seg[i - 1] > seg[i] (then the offsets are unused). Each
// position i writes the t in (seg[i - 1], seg[i]], clamped to [-1, S]: O(N + S) in all.
__global__ void OffsetsKernel(Args a, int64_t* offsets, int32_t* unsorted) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i <= a.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t prev = i > 0 ? DevLoadIdAny(a.seg, a.seg64, i - 1) : -1;
    const int64_t cur = i < a.n ? DevLoadIdAny(a.seg, a.seg64, i) : a.num_segments;
    if (i > 0 && i < a.n && prev > cur) {
      *unsorted = 1;
      continue;
    }
    const int64_t hi = Clamp(cur, -1, a.num_segments);
    for (int64_t t = Clamp(prev, -1, a.num_segments) + 1; t <= hi; ++t) offsets[t] = i;
  }
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

// One warp per bag (see the top of the file). VEC: columns per lane (4 needs D % 4 == 0);
// LPR: lanes per row, so 32 / LPR rows are gathered at once.
template <typename T, typename O, int VEC, int LPR>
__global__ void __launch_bounds__(128)
    PoolSortedKernel(const T* __restrict__ table, Args a, const int64_t* __restrict__ offsets,
                     const int32_t* unsorted, O* __restrict__ out) {
  if (*unsorted) return;
  constexpr int kGroups = 32 / LPR;
  constexpr int kChunk = VEC * LPR;
  const int lane = threadIdx.x & 31, grp = lane / LPR, sub = lane % LPR;
  const bool sqrtn = a.combiner == Combiner::SQRTN;
  for (int64_t s = GridWarp(); s < a.num_segments; s += GridWarps()) {
    const int64_t lo = offsets[s], hi = offsets[s + 1];
    float part = 0.0f, scale = 1.0f;
    for (int64_t c0 = 0; c0 < a.d; c0 += kChunk) {
      const int64_t j = c0 + VEC * sub;
      float acc[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
      for (int64_t b = lo; b < hi; b += 32) {
        const int64_t i = b + lane;
        int64_t my_id = -1;
        float my_w = 0.0f;
        if (i < hi) {
          my_id = ValidId(a, i);
          if (my_id >= 0) my_w = WeightAt(a, i);
        }
        if (c0 == 0) part += sqrtn ? my_w * my_w : my_w;
        const int cnt = hi - b < 32 ? static_cast<int>(hi - b) : 32;
        for (int k0 = 0; k0 < cnt; k0 += kGroups) {
          const int k = k0 + grp;
          const long long id = __shfl_sync(kFull, static_cast<long long>(my_id), k);
          const float wi = __shfl_sync(kFull, my_w, k);
          if (k < cnt && id >= 0 && j < a.d) {
            const int64_t e = static_cast<int64_t>(id) * a.d + j;
            if constexpr (VEC == 4) {
              const float4 r = Load4<T>(table, e);
              acc[0] += wi * r.x;
              acc[1] += wi * r.y;
              acc[2] += wi * r.z;
              acc[3] += wi * r.w;
            } else {
              acc[0] += wi * DevElem<T>::Load(table, e);
            }
          }
        }
      }
#pragma unroll
      for (int o = LPR; o < 32; o <<= 1) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] += __shfl_xor_sync(kFull, acc[v], o);
      }
      if (c0 == 0) scale = ScaleFor(a.combiner, WarpSum(part));
      if (grp == 0 && j < a.d) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) DevElem<O>::Store(out, s * a.d + j + v, acc[v] * scale);
      }
    }
  }
}

// The atomic path's kernels do nothing when `only_if` is non-null and *only_if == 0: after
// a sorted pass, they run only if the order check failed.
__global__ void ZeroKernel(float* p, int64_t count, const int32_t* only_if) {
  if (only_if != nullptr && *only_if == 0) return;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[e] = 0.0f;
  }
}

__global__ void DenomKernel(Args a, float* denom, const int32_t* only_if) {
  if (only_if != nullptr && *only_if == 0) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < a.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = DevLoadIdAny(a.seg, a.seg64, i);
    if (s < 0 || s >= a.num_segments || ValidId(a, i) < 0) continue;
    const float wi = WeightAt(a, i);
    atomicAdd(denom + s, a.combiner == Combiner::SQRTN ? wi * wi : wi);
  }
}

template <typename T>
__global__ void PoolAtomicKernel(const T* __restrict__ table, Args a, const float* denom,
                                 float* acc, const int32_t* only_if) {
  if (only_if != nullptr && *only_if == 0) return;
  const int lane = threadIdx.x & 31;
  for (int64_t i = GridWarp(); i < a.n; i += GridWarps()) {
    const int64_t s = DevLoadIdAny(a.seg, a.seg64, i);
    const int64_t id = ValidId(a, i);
    if (s < 0 || s >= a.num_segments || id < 0) continue;
    const float c = WeightAt(a, i) * ScaleFor(a.combiner, denom[s]);
    for (int64_t j = lane; j < a.d; j += 32) {
      atomicAdd(acc + s * a.d + j, c * DevElem<T>::Load(table, id * a.d + j));
    }
  }
}

template <typename T, typename O>
__global__ void GatherRowsKernel(const T* __restrict__ table, Args a, O* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = GridWarp(); i < a.n; i += GridWarps()) {
    const int64_t id = ValidId(a, i);
    const float wi = id >= 0 ? WeightAt(a, i) : 0.0f;
    for (int64_t j = lane; j < a.d; j += 32) {
      DevElem<O>::Store(out, i * a.d + j, id >= 0 ? wi * DevElem<T>::Load(table, id * a.d + j) : 0.0f);
    }
  }
}

template <typename T, typename O, int VEC>
void LaunchSorted(cudaStream_t stream, const T* t, const Args& a, const int64_t* offsets,
                  const int32_t* unsorted, O* o) {
  const int threads = 128;
  const unsigned grid = GridFor(a.num_segments, threads / 32);
  const int64_t lanes = (a.d + VEC - 1) / VEC;  // lanes one row needs
  if (lanes > 16) {
    PoolSortedKernel<T, O, VEC, 32><<<grid, threads, 0, stream>>>(t, a, offsets, unsorted, o);
  } else if (lanes > 8) {
    PoolSortedKernel<T, O, VEC, 16><<<grid, threads, 0, stream>>>(t, a, offsets, unsorted, o);
  } else {
    PoolSortedKernel<T, O, VEC, 8><<<grid, threads, 0, stream>>>(t, a, offsets, unsorted, o);
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
    return CudaStatus("lookup_pool");
  }
  const PoolLayout L = MakePoolLayout(a.num_segments, a.d);
  if (workspace_bytes < L.total) {
    return InvalidArgument("lookup_pool: workspace must have at least " +
                           std::to_string(L.total) +
                           " bytes (_ffi_cuda.lookup_pool_workspace_bytes), got " +
                           std::to_string(workspace_bytes));
  }
  char* ws = static_cast<char*>(workspace);
  int32_t* flag = reinterpret_cast<int32_t*>(ws + L.flag);
  int64_t* offsets = reinterpret_cast<int64_t*>(ws + L.offsets);
  float* denom = reinterpret_cast<float*>(ws + L.denom);
  float* acc = reinterpret_cast<float*>(ws + L.acc);
  const int32_t* only_if = nullptr;  // the atomic path runs unconditionally
  if (sorted) {
    EMBARK_CUDA_RETURN_IF_ERROR("lookup_pool",
                                cudaMemsetAsync(flag, 0, sizeof(int32_t), stream));
    OffsetsKernel<<<GridFor(a.n + 1, threads), threads, 0, stream>>>(a, offsets, flag);
    if (a.d % 4 == 0) {
      LaunchSorted<T, O, 4>(stream, t, a, offsets, flag, o);
    } else {
      LaunchSorted<T, O, 1>(stream, t, a, offsets, flag, o);
    }
    only_if = flag;  // the atomic path runs only if the ids were not sorted after all
  }
  const int64_t s = a.num_segments;
  ZeroKernel<<<GridFor(s, threads), threads, 0, stream>>>(denom, s, only_if);
  ZeroKernel<<<GridFor(s * a.d, threads), threads, 0, stream>>>(acc, s * a.d, only_if);
  if (a.combiner != Combiner::SUM) {
    DenomKernel<<<GridFor(a.n, threads), threads, 0, stream>>>(a, denom, only_if);
  }
  PoolAtomicKernel<T><<<GridFor(a.n, warps_per_block), threads, 0, stream>>>(t, a, denom, acc,
                                                                            only_if);
  ConvertKernel<O><<<GridFor(s * a.d, threads), threads, 0, stream>>>(acc, s * a.d, o, only_if);
  return CudaStatus("lookup_pool");
}

ffi::Error LookupPoolCudaImpl(cudaStream_t stream, ffi::AnyBuffer table, ffi::AnyBuffer ids,
                              ffi::AnyBuffer seg, ffi::AnyBuffer weights,
                              ffi::Result<ffi::AnyBuffer> workspace, ffi::RemainingRets outs,
                              int64_t combiner, int64_t indices_are_sorted) {
  std::vector<ffi::AnyBuffer> pieces;
  ffi::Error err = CheckLookupPool(table, ids, seg, weights, outs, combiner, &pieces);
  if (err.failure()) return err;
  // One piece on the GPU: ops._ffi splits the output there (a device slice is cheap next to
  // the host's copy and fresh pages that the pieces avoid).
  if (pieces.size() != 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "lookup_pool: the CUDA kernel writes the output as one [S, D] piece, got " +
                          std::to_string(pieces.size()));
  }
  ffi::AnyBuffer* out = &pieces[0];
  const int64_t n = static_cast<int64_t>(ids.element_count());
  Args a{ids.untyped_data(),
         ids.element_type() == ffi::DataType::S64,
         seg.untyped_data(),
         seg.element_type() == ffi::DataType::S64,
         weights.element_count() == 0 ? nullptr  // [0]: unweighted (CheckLookupPool)
                                      : static_cast<const float*>(weights.untyped_data()),
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
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace
                                  .RemainingRets()             // the output, one piece
                                  .Attr<int64_t>("combiner")
                                  .Attr<int64_t>("indices_are_sorted"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
