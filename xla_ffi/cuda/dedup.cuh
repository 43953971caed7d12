// GPU dedup shared by unique, sparse_grad and sparse_grad_update: a CUB radix sort of
// (id, position) pairs and the run structure of the sorted ids, all in a caller-provided
// workspace (no allocation, no host sync: CUDA-graph compatible).
#pragma once

#include <cub/cub.cuh>

#include "common.cuh"

namespace embark {

// Byte layout of the dedup workspace for n ids with key_bytes-wide keys (4 or 8).
struct DedupLayout {
  size_t keys_a, keys_b, vals_a, vals_b, flags, slots, run_start, cub_temp, cub_bytes, total;
};

inline size_t AlignUp(size_t x) { return (x + 255) & ~size_t{255}; }

// Computes the layout; the CUB temp size query does no allocation and no sync.
DedupLayout DedupWorkspaceLayout(int64_t n, int key_bytes);

// Sorted-run view of the ids after RunDedup, all device pointers into the workspace.
struct DedupView {
  const void* sorted_keys;  // uint32 or uint64 keys; invalid ids sort last as all-ones
  const int32_t* positions;  // original position of each sorted id
  const int32_t* slot;       // slot (unique index) of each sorted id, -1 for invalid
  const int32_t* run_start;  // [n + 1]: run_start[k] = first sorted index of slot k; the
                             // entry after the last slot holds the number of valid ids
  int32_t* num_unique;       // device scalar
};

// Sorts the ids and builds the runs. num_unique must point to device memory (an output).
ffi::Error RunDedup(cudaStream_t stream, const void* ids, bool ids64, int64_t n, void* workspace,
                    size_t workspace_bytes, int32_t* num_unique, DedupView* view);

template <typename K>
__device__ __forceinline__ int64_t KeyToId(const void* keys, int64_t t) {
  K k = static_cast<const K*>(keys)[t];
  return k == static_cast<K>(~K(0)) ? -1 : static_cast<int64_t>(k);
}

__device__ __forceinline__ int64_t SortedId(const DedupView& v, bool ids64, int64_t t) {
  return ids64 ? KeyToId<uint64_t>(v.sorted_keys, t) : KeyToId<uint32_t>(v.sorted_keys, t);
}

}  // namespace embark
