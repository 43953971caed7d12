// The hash table of a dynamic embedding table on CUDA (docs/design.md §11). The per-id rules
// are embark_hash_table.h's, the same functions the CPU kernels run.
//
// find: a thread per id (read only).
// find_or_insert must give the result of processing the ids one at a time, in order. Ids of
// different buckets never interact, so the ids are sorted by bucket with CUB's radix sort,
// which is stable (positions stay ascending inside a bucket), and one thread per bucket
// present processes that bucket's ids in order. Counts are integer sums (atomics, any
// order). Everything lives in a workspace sized by HashTableWorkspaceBytes: no allocation,
// no host sync (CUDA-graph compatible). A bucket that receives many ids in one call (an
// adversarial stream) is processed by one thread: correct, and slower.
#include <cub/cub.cuh>

#include <climits>
#include <stdexcept>

#include "common.cuh"
#include "embark_hash_table.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

struct HashLayout {
  size_t keys_a, keys_b, vals_a, vals_b, cub_temp, cub_bytes, total;
  cudaError_t cub_status;
};

HashLayout Layout(int64_t n) {
  HashLayout L{};
  const size_t m = static_cast<size_t>(n < 1 ? 1 : n);
  WorkspacePieces w;
  L.keys_a = w.Take(m * 4);
  L.keys_b = w.Take(m * 4);
  L.vals_a = w.Take(m * 4);
  L.vals_b = w.Take(m * 4);
  cub::DoubleBuffer<uint32_t> k(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> v(nullptr, nullptr);
  L.cub_bytes = 0;
  L.cub_status = cub::DeviceRadixSort::SortPairs(nullptr, L.cub_bytes, k, v, static_cast<int>(m));
  L.cub_temp = w.Take(L.cub_bytes);
  L.total = w.total;
  return L;
}

// The fewest radix bits that hold every bucket index and the padding key `buckets`.
int BucketBits(int64_t buckets) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= buckets) ++bits;
  return bits;
}

__global__ void HashFindKernel(const uint32_t* keys, const int32_t* scores, const uint32_t* ids,
                               const int32_t* step, int64_t n, int64_t buckets,
                               int64_t bucket_size, int64_t ttl, int32_t* slots) {
  const int32_t now = *step;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t lo = ids[2 * i], hi = ids[2 * i + 1];
    const int64_t b = hash::BucketOf(lo, hi, buckets);
    slots[i] = static_cast<int32_t>(hash::FindInBucket(keys, scores, b, bucket_size, lo, hi, now, ttl));
  }
}

// Sort keys (the bucket, or `buckets` for padding, which sorts last) and positions; every
// id's outputs start as "not inserted" (padding keeps them).
__global__ void BucketKeys(const uint32_t* ids, int64_t n, int64_t buckets, uint32_t* keys,
                           int32_t* vals, int32_t* slots, bool* fresh) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t lo = ids[2 * i], hi = ids[2 * i + 1];
    keys[i] = hash::IsEmpty(lo, hi) ? static_cast<uint32_t>(buckets)
                                    : static_cast<uint32_t>(hash::BucketOf(lo, hi, buckets));
    vals[i] = static_cast<int32_t>(i);
    slots[i] = -1;
    fresh[i] = false;
  }
}

// One thread per run of equal buckets in the sorted keys: the thread at a run's first index
// processes the run's ids in order (their positions ascend: the sort is stable).
__global__ void InsertRuns(hash::Table t, const uint32_t* ids, const uint32_t* sorted,
                           const int32_t* positions, int64_t n, const int32_t* step,
                           int32_t* slots, bool* fresh, int32_t* counts) {
  t.step = *step;
  const uint32_t pad = static_cast<uint32_t>(t.num_buckets);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t b = sorted[r];
    if (b == pad || (r > 0 && sorted[r - 1] == b)) continue;
    int64_t local[abi::kNumHashCounts] = {};
    for (int64_t u = r; u < n && sorted[u] == b; ++u) {
      const int64_t i = positions[u];
      bool f = false;
      slots[i] = static_cast<int32_t>(
          hash::FindOrInsertOne(t, static_cast<int64_t>(b), ids[2 * i], ids[2 * i + 1], local, &f));
      fresh[i] = f;
    }
    for (int j = 0; j < abi::kNumHashCounts; ++j) {
      if (local[j] != 0) atomicAdd(counts + j, static_cast<int32_t>(local[j]));
    }
  }
}

ffi::Error HashFindCuda(cudaStream_t stream, const HashFindOperands& o) {
  const int64_t n = o.ids.dimensions()[0];
  const int64_t buckets = hash::PairRows(o.keys) / o.bucket_size;
  if (n > 0) {
    HashFindKernel<<<GridFor(n, 256), 256, 0, stream>>>(
        static_cast<const uint32_t*>(o.keys.untyped_data()),
        static_cast<const int32_t*>(o.scores.untyped_data()),
        static_cast<const uint32_t*>(o.ids.untyped_data()),
        static_cast<const int32_t*>(o.step.untyped_data()), n, buckets, o.bucket_size, o.ttl,
        static_cast<int32_t*>(o.slots.untyped_data()));
  }
  return CudaStatus("hash_find");
}

// Checks that n ids fit the CUB sort and the int32 positions, then lays out their workspace
// in *layout and checks that `workspace` holds it.
ffi::Error PlanWorkspace(const char* what, int64_t n, const ffi::AnyBuffer& workspace,
                         HashLayout* layout) {
  if (n > static_cast<int64_t>(INT_MAX) - 1) {
    return InvalidArgument(std::string(what) + ": at most " + std::to_string(INT_MAX - 1) +
                           " ids (CUB's item count and the int32 positions), got " +
                           std::to_string(n));
  }
  *layout = Layout(n);
  const HashLayout& L = *layout;
  if (L.cub_status != cudaSuccess) {
    return CudaError(what, "CUB temporary storage query", L.cub_status);
  }
  if (workspace.size_bytes() < L.total) {
    return InvalidArgument(std::string(what) + ": workspace has " +
                           std::to_string(workspace.size_bytes()) + " bytes, needs " +
                           std::to_string(L.total) +
                           " (size it with _ffi_cuda.hash_table_workspace_bytes)");
  }
  return ffi::Error::Success();
}

// Sorts the ids' positions by bucket, then runs each bucket's ids in order (a thread each).
ffi::Error InsertSorted(const char* what, cudaStream_t stream, const HashFindOrInsertOperands& o,
                        const HashLayout& L, int64_t n, int32_t* cnt) {
  // the step is read on the device
  const hash::Table t = hash::TableOver(o, 0);
  const int64_t buckets = t.num_buckets;
  char* ws = static_cast<char*>(o.workspace.untyped_data());
  uint32_t* ka = reinterpret_cast<uint32_t*>(ws + L.keys_a);
  uint32_t* kb = reinterpret_cast<uint32_t*>(ws + L.keys_b);
  int32_t* va = reinterpret_cast<int32_t*>(ws + L.vals_a);
  int32_t* vb = reinterpret_cast<int32_t*>(ws + L.vals_b);
  const uint32_t* w = static_cast<const uint32_t*>(o.ids.untyped_data());
  int32_t* out = static_cast<int32_t*>(o.slots.untyped_data());
  bool* fr = static_cast<bool*>(o.fresh.untyped_data());
  BucketKeys<<<GridFor(n, 256), 256, 0, stream>>>(w, n, buckets, ka, va, out, fr);
  cub::DoubleBuffer<uint32_t> sk(ka, kb);
  cub::DoubleBuffer<int32_t> sv(va, vb);
  size_t temp = L.cub_bytes;
  EMBARK_CUDA_RETURN_IF_ERROR(
      what, cub::DeviceRadixSort::SortPairs(ws + L.cub_temp, temp, sk, sv, static_cast<int>(n), 0,
                                            BucketBits(buckets), stream));
  InsertRuns<<<GridFor(n, 128), 128, 0, stream>>>(
      t, w, sk.Current(), sv.Current(), n, static_cast<const int32_t*>(o.step.untyped_data()),
      out, fr, cnt);
  return CudaStatus(what);
}

ffi::Error HashFindOrInsertCuda(cudaStream_t stream, const HashFindOrInsertOperands& o) {
  const char* what = "hash_find_or_insert";
  const int64_t n = o.ids.dimensions()[0];
  HashLayout L{};
  ffi::Error err = PlanWorkspace(what, n, o.workspace, &L);
  if (err.failure()) return err;
  err = StartFromInputs(what, stream,
                        {Same(o.keys_out, o.keys), Same(o.scores_out, o.scores),
                         Same(o.cand_keys_out, o.cand_keys),
                         Same(o.cand_scores_out, o.cand_scores)});
  if (err.failure()) return err;
  int32_t* cnt = static_cast<int32_t*>(o.counts.untyped_data());
  EMBARK_CUDA_RETURN_IF_ERROR(
      what, cudaMemsetAsync(cnt, 0, sizeof(int32_t) * abi::kNumHashCounts, stream));
  if (n == 0) return CudaStatus(what);
  return InsertSorted(what, stream, o, L, n, cnt);
}

}  // namespace

size_t HashTableWorkspaceBytes(int64_t n) {
  const HashLayout L = Layout(n);
  if (L.cub_status != cudaSuccess) {
    throw std::runtime_error(
        std::string("embark_jax CUDA hash_find_or_insert: CUB temporary storage query: ") +
        cudaGetErrorString(L.cub_status));
  }
  return L.total;
}

}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkHashFindCuda,
                              embark::CheckedHandler(embark::CheckHashFind, embark::HashFindCuda),
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  EMBARK_HASH_FIND_OPERANDS,
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkHashFindOrInsertCuda,
                              embark::CheckedHandler(embark::CheckHashFindOrInsert,
                                                     embark::HashFindOrInsertCuda),
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  EMBARK_HASH_FIND_OR_INSERT_OPERANDS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
