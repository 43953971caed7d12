#include "dedup.cuh"

namespace embark {
namespace {

template <typename K>
__global__ void MakeKeys(const void* ids, bool ids64, int64_t n, K* keys, int32_t* vals) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t id = DevLoadIdAny(ids, ids64, i);
    keys[i] = id < 0 ? static_cast<K>(~K(0)) : static_cast<K>(id);
    vals[i] = static_cast<int32_t>(i);
  }
}

template <typename K>
__global__ void MarkRuns(const K* keys, int64_t n, int32_t* flags) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const K invalid = static_cast<K>(~K(0));
    flags[t] = keys[t] != invalid && (t == 0 || keys[t] != keys[t - 1]) ? 1 : 0;
  }
}

// slots holds the inclusive prefix sum of flags on entry; becomes slot index (or -1).
template <typename K>
__global__ void FinishRuns(const K* keys, int64_t n, const int32_t* flags, int32_t* slots,
                           int32_t* run_start, int32_t* num_unique) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const K invalid = static_cast<K>(~K(0));
    const bool valid = keys[t] != invalid;
    const int32_t slot = slots[t] - 1;
    if (flags[t]) run_start[slot] = static_cast<int32_t>(t);
    const bool last_valid = valid && (t + 1 == n || keys[t + 1] == invalid);
    if (last_valid) {
      run_start[slot + 1] = static_cast<int32_t>(t + 1);
      *num_unique = slot + 1;
    }
    slots[t] = valid ? slot : -1;
  }
}

inline unsigned Blocks(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

template <typename K>
size_t CubBytes(int64_t n) {
  size_t sort_bytes = 0, scan_bytes = 0;
  cub::DoubleBuffer<K> k(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> v(nullptr, nullptr);
  cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, k, v, static_cast<int>(n));
  cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, static_cast<int32_t*>(nullptr),
                                static_cast<int32_t*>(nullptr), static_cast<int>(n));
  return sort_bytes > scan_bytes ? sort_bytes : scan_bytes;
}

template <typename K>
ffi::Error Dedup(cudaStream_t stream, const void* ids, bool ids64, int64_t n, char* ws,
                 const DedupLayout& L, int32_t* num_unique, DedupView* view) {
  K* ka = reinterpret_cast<K*>(ws + L.keys_a);
  K* kb = reinterpret_cast<K*>(ws + L.keys_b);
  int32_t* va = reinterpret_cast<int32_t*>(ws + L.vals_a);
  int32_t* vb = reinterpret_cast<int32_t*>(ws + L.vals_b);
  int32_t* flags = reinterpret_cast<int32_t*>(ws + L.flags);
  int32_t* slots = reinterpret_cast<int32_t*>(ws + L.slots);
  int32_t* run_start = reinterpret_cast<int32_t*>(ws + L.run_start);
  cudaMemsetAsync(num_unique, 0, sizeof(int32_t), stream);
  cudaMemsetAsync(run_start, 0, sizeof(int32_t) * (n + 1), stream);
  if (n > 0) {
    MakeKeys<K><<<Blocks(n, 256), 256, 0, stream>>>(ids, ids64, n, ka, va);
    cub::DoubleBuffer<K> keys(ka, kb);
    cub::DoubleBuffer<int32_t> vals(va, vb);
    size_t temp = L.cub_bytes;
    cub::DeviceRadixSort::SortPairs(ws + L.cub_temp, temp, keys, vals, static_cast<int>(n), 0,
                                    static_cast<int>(8 * sizeof(K)), stream);
    const K* sorted = keys.Current();
    MarkRuns<K><<<Blocks(n, 256), 256, 0, stream>>>(sorted, n, flags);
    temp = L.cub_bytes;
    cub::DeviceScan::InclusiveSum(ws + L.cub_temp, temp, flags, slots, static_cast<int>(n),
                                  stream);
    FinishRuns<K><<<Blocks(n, 256), 256, 0, stream>>>(sorted, n, flags, slots, run_start,
                                                       num_unique);
    view->sorted_keys = sorted;
    view->positions = vals.Current();
  } else {
    view->sorted_keys = ka;
    view->positions = va;
  }
  view->slot = slots;
  view->run_start = run_start;
  view->num_unique = num_unique;
  return CudaStatus("dedup");
}

}  // namespace

DedupLayout DedupWorkspaceLayout(int64_t n, int key_bytes) {
  DedupLayout L{};
  const size_t m = static_cast<size_t>(n < 1 ? 1 : n);
  size_t off = 0;
  auto take = [&off](size_t bytes) {
    size_t at = off;
    off += AlignUp(bytes);
    return at;
  };
  L.keys_a = take(m * key_bytes);
  L.keys_b = take(m * key_bytes);
  L.vals_a = take(m * 4);
  L.vals_b = take(m * 4);
  L.flags = take(m * 4);
  L.slots = take(m * 4);
  L.run_start = take((m + 1) * 4);
  L.cub_bytes = key_bytes == 8 ? CubBytes<uint64_t>(static_cast<int64_t>(m))
                               : CubBytes<uint32_t>(static_cast<int64_t>(m));
  L.cub_temp = take(L.cub_bytes);
  L.total = off;
  return L;
}

ffi::Error RunDedup(cudaStream_t stream, const void* ids, bool ids64, int64_t n, void* workspace,
                    size_t workspace_bytes, int32_t* num_unique, DedupView* view) {
  DedupLayout L = DedupWorkspaceLayout(n, ids64 ? 8 : 4);
  if (workspace_bytes < L.total) {
    return InvalidArgument("dedup workspace has " + std::to_string(workspace_bytes) +
                           " bytes, needs " + std::to_string(L.total) +
                           " (size it with _ffi_cuda.dedup_workspace_bytes)");
  }
  char* ws = static_cast<char*>(workspace);
  return ids64 ? Dedup<uint64_t>(stream, ids, ids64, n, ws, L, num_unique, view)
               : Dedup<uint32_t>(stream, ids, ids64, n, ws, L, num_unique, view);
}

}  // namespace embark

namespace embark {
size_t DedupWorkspaceBytes(int64_t n, int key_bytes) {
  return DedupWorkspaceLayout(n, key_bytes).total;
}
}  // namespace embark
