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
  size_t piece_count, piece_end, partial;  // the long-run split (row width d > 0 only)
  int64_t max_pieces;
  cudaError_t cub_status;  // of CUB's size query; total is meaningless unless cudaSuccess
};

// Hot ids: a run (the positions of one distinct id) longer than kLongRun is split into
// pieces of kPiece ids, reduced by separate warps into float32 partial rows, and the row's
// gradient is the sum of its pieces (a second pass), as FBGEMM does, so that one very hot id
// does not leave one warp reducing tens of thousands of rows serially. A split run has at
// most ceil(len / kPiece) < 3 len / 512 pieces, so n ids need at most 3 n / 512 + 1 pieces.
constexpr int64_t kLongRun = 512;
constexpr int64_t kPiece = 256;
inline int64_t MaxPieces(int64_t n) { return 3 * n / 512 + 1; }

// Computes the layout for n ids; d > 0 adds the long-run split for rows of width d. The CUB
// temp size query does no allocation and no sync.
DedupLayout DedupWorkspaceLayout(int64_t n, int key_bytes, int64_t d);

// Sorted-run view of the ids after RunDedup, all device pointers into the workspace.
struct DedupView {
  const void* sorted_keys;  // uint32 or uint64 keys; invalid ids sort last as all-ones
  const int32_t* positions;  // original position of each sorted id
  const int32_t* slot;       // slot (unique index) of each sorted id, -1 for invalid
  const int32_t* run_start;  // [n + 1]: run_start[k] = first sorted index of slot k; the
                             // entry after the last slot holds the number of valid ids
  int32_t* num_unique;       // device scalar
  // With the long-run split (RunDedup's d > 0), else null:
  const int32_t* piece_count;  // [n]: pieces of slot k (0: not split)
  const int32_t* piece_end;    // [n]: inclusive prefix sum of piece_count
  float* partial;              // [max_pieces, d]: one partial row per piece
  int64_t max_pieces;
};

// Slot k's run is split into pieces (see kLongRun).
__device__ __forceinline__ bool IsSplit(const DedupView& v, int64_t k) {
  return v.piece_count != nullptr && v.piece_count[k] > 0;
}

// Sorts the ids and builds the runs. num_unique must point to device memory (an output).
// With vocab > 0, ids >= vocab are padding too and the radix sort looks at only the
// ceil(log2(vocab + 1)) low bits of the keys; vocab <= 0: all bits (ids of any size).
// CUB's and CUDA's errors come back as FFI errors.
// d > 0: also count the pieces of long runs (piece_count, piece_end) for rows of width d;
// the caller reduces the pieces into `partial` before its per-row pass.
ffi::Error RunDedup(cudaStream_t stream, const void* ids, bool ids64, int64_t n, int64_t vocab,
                    int64_t d, void* workspace, size_t workspace_bytes, int32_t* num_unique,
                    DedupView* view);

template <typename K>
__device__ __forceinline__ int64_t KeyToId(const void* keys, int64_t t) {
  K k = static_cast<const K*>(keys)[t];
  return k == static_cast<K>(~K(0)) ? -1 : static_cast<int64_t>(k);
}

__device__ __forceinline__ int64_t SortedId(const DedupView& v, bool ids64, int64_t t) {
  return ids64 ? KeyToId<uint64_t>(v.sorted_keys, t) : KeyToId<uint32_t>(v.sorted_keys, t);
}

}  // namespace embark
