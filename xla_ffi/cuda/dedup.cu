#include <climits>
#include <stdexcept>

#include "dedup.cuh"

namespace embark {
namespace {

// Keys: the id, or all ones for padding (id < 0, or id >= vocab when vocab > 0), which
// sorts last.
template <typename K>
__global__ void MakeKeys(const void* ids, bool ids64, int64_t n, int64_t vocab, K* keys,
                         int32_t* vals) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t id = DevLoadIdAny(ids, ids64, i);
    const bool pad = id < 0 || (vocab > 0 && id >= vocab);
    keys[i] = pad ? static_cast<K>(~K(0)) : static_cast<K>(id);
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

// piece_count[k]: the pieces of slot k's run if it is long, else 0 (0 for k >= num_unique).
__global__ void CountPieces(const int32_t* run_start, const int32_t* num_unique, int64_t n,
                            int32_t* piece_count) {
  const int64_t u = *num_unique;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t len = k < u ? run_start[k + 1] - run_start[k] : 0;
    piece_count[k] = len > kLongRun ? static_cast<int32_t>((len + kPiece - 1) / kPiece) : 0;
  }
}

inline unsigned Blocks(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

// The radix sort's bits: all of the key's, or, with a known vocab V, ceil(log2(V + 1)), the
// fewest that hold every valid id and keep the all-ones padding key above them (its low
// bits are 2^bits - 1 >= V).
template <typename K>
int SortBits(int64_t vocab) {
  int bits = 1;
  if (vocab <= 0) return static_cast<int>(8 * sizeof(K));
  while (bits < static_cast<int>(8 * sizeof(K)) && (int64_t{1} << bits) <= vocab) ++bits;
  return bits;
}

// CUB's temporary storage for n items (a size query: no allocation, no sync).
template <typename K>
cudaError_t CubBytes(int64_t n, size_t* bytes) {
  size_t sort_bytes = 0, scan_bytes = 0;
  cub::DoubleBuffer<K> k(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> v(nullptr, nullptr);
  cudaError_t err = cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, k, v, static_cast<int>(n));
  if (err != cudaSuccess) return err;
  err = cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, static_cast<int32_t*>(nullptr),
                                      static_cast<int32_t*>(nullptr), static_cast<int>(n));
  if (err != cudaSuccess) return err;
  *bytes = sort_bytes > scan_bytes ? sort_bytes : scan_bytes;
  return cudaSuccess;
}

template <typename K>
ffi::Error Dedup(cudaStream_t stream, const void* ids, bool ids64, int64_t n, int64_t vocab,
                 int64_t d, char* ws, const DedupLayout& L, int32_t* num_unique,
                 DedupView* view) {
  K* ka = reinterpret_cast<K*>(ws + L.keys_a);
  K* kb = reinterpret_cast<K*>(ws + L.keys_b);
  int32_t* va = reinterpret_cast<int32_t*>(ws + L.vals_a);
  int32_t* vb = reinterpret_cast<int32_t*>(ws + L.vals_b);
  int32_t* flags = reinterpret_cast<int32_t*>(ws + L.flags);
  int32_t* slots = reinterpret_cast<int32_t*>(ws + L.slots);
  int32_t* run_start = reinterpret_cast<int32_t*>(ws + L.run_start);
  EMBARK_CUDA_RETURN_IF_ERROR("dedup", cudaMemsetAsync(num_unique, 0, sizeof(int32_t), stream));
  EMBARK_CUDA_RETURN_IF_ERROR(
      "dedup", cudaMemsetAsync(run_start, 0, sizeof(int32_t) * (n + 1), stream));
  if (n > 0) {
    MakeKeys<K><<<Blocks(n, 256), 256, 0, stream>>>(ids, ids64, n, vocab, ka, va);
    cub::DoubleBuffer<K> keys(ka, kb);
    cub::DoubleBuffer<int32_t> vals(va, vb);
    size_t temp = L.cub_bytes;
    EMBARK_CUDA_RETURN_IF_ERROR(
        "dedup", cub::DeviceRadixSort::SortPairs(ws + L.cub_temp, temp, keys, vals,
                                                 static_cast<int>(n), 0, SortBits<K>(vocab),
                                                 stream));
    const K* sorted = keys.Current();
    MarkRuns<K><<<Blocks(n, 256), 256, 0, stream>>>(sorted, n, flags);
    temp = L.cub_bytes;
    EMBARK_CUDA_RETURN_IF_ERROR(
        "dedup", cub::DeviceScan::InclusiveSum(ws + L.cub_temp, temp, flags, slots,
                                               static_cast<int>(n), stream));
    FinishRuns<K><<<Blocks(n, 256), 256, 0, stream>>>(sorted, n, flags, slots, run_start,
                                                       num_unique);
    view->sorted_keys = sorted;
    view->positions = vals.Current();
    if (d > 0) {
      int32_t* count = reinterpret_cast<int32_t*>(ws + L.piece_count);
      int32_t* end = reinterpret_cast<int32_t*>(ws + L.piece_end);
      CountPieces<<<Blocks(n, 256), 256, 0, stream>>>(run_start, num_unique, n, count);
      temp = L.cub_bytes;
      EMBARK_CUDA_RETURN_IF_ERROR(
          "dedup", cub::DeviceScan::InclusiveSum(ws + L.cub_temp, temp, count, end,
                                                 static_cast<int>(n), stream));
      view->piece_count = count;
      view->piece_end = end;
      view->partial = reinterpret_cast<float*>(ws + L.partial);
      view->max_pieces = L.max_pieces;
    }
  } else {
    view->sorted_keys = ka;
    view->positions = va;
  }
  if (n == 0 || d <= 0) {
    view->piece_count = nullptr;
    view->piece_end = nullptr;
    view->partial = nullptr;
    view->max_pieces = 0;
  }
  view->slot = slots;
  view->run_start = run_start;
  view->num_unique = num_unique;
  return CudaStatus("dedup");
}

}  // namespace

DedupLayout DedupWorkspaceLayout(int64_t n, int key_bytes, int64_t d) {
  DedupLayout L{};
  const size_t m = static_cast<size_t>(n < 1 ? 1 : n);
  WorkspacePieces w;
  L.keys_a = w.Take(m * key_bytes);
  L.keys_b = w.Take(m * key_bytes);
  L.vals_a = w.Take(m * 4);
  L.vals_b = w.Take(m * 4);
  L.flags = w.Take(m * 4);
  L.slots = w.Take(m * 4);
  L.run_start = w.Take((m + 1) * 4);
  L.cub_status = key_bytes == 8 ? CubBytes<uint64_t>(static_cast<int64_t>(m), &L.cub_bytes)
                                : CubBytes<uint32_t>(static_cast<int64_t>(m), &L.cub_bytes);
  L.cub_temp = w.Take(L.cub_bytes);
  if (d > 0) {
    L.max_pieces = MaxPieces(static_cast<int64_t>(m));
    L.piece_count = w.Take(m * 4);
    L.piece_end = w.Take(m * 4);
    L.partial = w.Take(static_cast<size_t>(L.max_pieces) * static_cast<size_t>(d) * 4);
  }
  L.total = w.total;
  return L;
}

ffi::Error RunDedup(cudaStream_t stream, const void* ids, bool ids64, int64_t n, int64_t vocab,
                    int64_t d, void* workspace, size_t workspace_bytes, int32_t* num_unique,
                    DedupView* view) {
  if (n > static_cast<int64_t>(INT_MAX) - 1) {
    return InvalidArgument("dedup: at most " + std::to_string(INT_MAX - 1) +
                           " ids (CUB's item count and the int32 positions), got " +
                           std::to_string(n));
  }
  DedupLayout L = DedupWorkspaceLayout(n, ids64 ? 8 : 4, d);
  if (L.cub_status != cudaSuccess) {
    return CudaError("dedup", "CUB temporary storage query", L.cub_status);
  }
  if (workspace_bytes < L.total) {
    return InvalidArgument("dedup workspace has " + std::to_string(workspace_bytes) +
                           " bytes, needs " + std::to_string(L.total) +
                           " (size it with _ffi_cuda.dedup_workspace_bytes)");
  }
  char* ws = static_cast<char*>(workspace);
  return ids64 ? Dedup<uint64_t>(stream, ids, ids64, n, vocab, d, ws, L, num_unique, view)
               : Dedup<uint32_t>(stream, ids, ids64, n, vocab, d, ws, L, num_unique, view);
}

}  // namespace embark

namespace embark {
size_t DedupWorkspaceBytes(int64_t n, int key_bytes, int64_t d) {
  const DedupLayout L = DedupWorkspaceLayout(n, key_bytes, d);
  if (L.cub_status != cudaSuccess) {
    throw std::runtime_error(std::string("embark_jax CUDA dedup: CUB temporary storage query: ") +
                             cudaGetErrorString(L.cub_status));
  }
  return L.total;
}
}  // namespace embark
