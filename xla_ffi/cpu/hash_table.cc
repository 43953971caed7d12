// The hash table of a dynamic embedding table on the CPU (docs/design.md §11): find (read
// only, parallel over ids) and find_or_insert (in place, the outputs alias the inputs). The
// per-id rules are embark_hash_table.h's, shared with the CUDA kernels.
//
// find_or_insert must give the result of processing the ids one at a time, in order. Ids of
// different buckets never interact, so the buckets are split into as many contiguous ranges
// as there are threads, and each thread processes, in order, the ids whose bucket is in its
// range: the same table and slots as one thread, whatever the thread count. The per-call
// counts are sums, summed per thread and then added.
#include <cstring>
#include <vector>

#include "cpu_optim.h"
#include "embark_ffi.h"
#include "embark_hash_table.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

// Ids below this run on the calling thread (the split costs a pass over the ids).
constexpr int64_t kParallelIds = 4096;
// find: ids whose bucket is computed and prefetched ahead of their probe, a block at a time.
constexpr int64_t kBlock = 16;
// find_or_insert: how many ids ahead a bucket is prefetched.
constexpr int64_t kAhead = 8;

ffi::Error HashFindCpu(ffi::ThreadPool pool, const HashFindOperands& o) {
  const uint32_t* k = static_cast<const uint32_t*>(o.keys.untyped_data());
  const int32_t* s = static_cast<const int32_t*>(o.scores.untyped_data());
  const uint32_t* w = static_cast<const uint32_t*>(o.ids.untyped_data());
  int32_t* out = static_cast<int32_t*>(o.slots.untyped_data());
  const int32_t now = *static_cast<const int32_t*>(o.step.untyped_data());
  const int64_t n = o.ids.dimensions()[0];
  const int64_t bucket_size = o.bucket_size, ttl = o.ttl;
  const int64_t buckets = hash::PairRows(o.keys) / bucket_size;
  ParallelFor(pool, n, 256, [=](int64_t i0, int64_t i1) {
    int64_t b[kBlock];
    for (int64_t i = i0; i < i1; i += kBlock) {
      const int64_t m = i + kBlock < i1 ? kBlock : i1 - i;
      for (int64_t u = 0; u < m; ++u) {
        b[u] = hash::BucketOf(w[2 * (i + u)], w[2 * (i + u) + 1], buckets);
        hash::PrefetchBucket(k, b[u], bucket_size);
      }
      for (int64_t u = 0; u < m; ++u) {
        const int64_t e = hash::FindInBucket(k, s, b[u], bucket_size, w[2 * (i + u)],
                                             w[2 * (i + u) + 1], now, ttl);
        out[i + u] = static_cast<int32_t>(e);
      }
    }
  });
  return ffi::Error::Success();
}

// Processes the ids at positions pos[0..m) in order; adds to counts.
void InsertRun(const hash::Table& t, const uint32_t* w, const int64_t* bucket_of,
               const int32_t* pos, int64_t m, int32_t* slots, bool* fresh, int64_t* counts) {
  for (int64_t u = 0; u < m; ++u) {
    if (u + kAhead < m) {  // the keys to scan, and the scores a hit or an eviction reads
      const int64_t b = bucket_of[pos[u + kAhead]];
      hash::PrefetchBucket(t.keys, b, t.bucket_size);
      hash::PrefetchBucket(reinterpret_cast<const uint32_t*>(t.scores), b, t.bucket_size);
    }
    const int64_t i = pos[u];
    bool f = false;
    slots[i] = static_cast<int32_t>(
        hash::FindOrInsertOne(t, bucket_of[i], w[2 * i], w[2 * i + 1], counts, &f));
    fresh[i] = f;
  }
}

// The ids' positions grouped by the part that owns their bucket, in order inside each part
// (a stable counting sort): part p owns buckets [p * B / parts, (p + 1) * B / parts), and its
// positions are pos[start[p], start[p + 1]).
struct PartIds {
  std::vector<int32_t> pos;
  std::vector<int64_t> start;
};

PartIds SplitByPart(const int64_t* bucket_of, int64_t n, int64_t buckets, int64_t parts) {
  PartIds s{std::vector<int32_t>(static_cast<size_t>(n)),
            std::vector<int64_t>(static_cast<size_t>(parts + 1), 0)};
  auto part_of = [=](int64_t b) { return b * parts / buckets; };
  for (int64_t i = 0; i < n; ++i) ++s.start[part_of(bucket_of[i]) + 1];
  for (int64_t p = 0; p < parts; ++p) s.start[p + 1] += s.start[p];
  std::vector<int64_t> next(s.start.begin(), s.start.end() - 1);
  for (int64_t i = 0; i < n; ++i) s.pos[next[part_of(bucket_of[i])]++] = static_cast<int32_t>(i);
  return s;
}

// find_or_insert of the n ids w (pairs of words) in t: slots, fresh and the summed counts.
void InsertAll(ffi::ThreadPool& pool, const hash::Table& t, const uint32_t* w, int64_t n,
               int32_t* out, bool* fr, int32_t* cnt) {
  const int64_t buckets = t.num_buckets;
  std::vector<int64_t> bucket_of(static_cast<size_t>(n));
  int64_t* bo = bucket_of.data();
  ParallelFor(pool, n, 1024, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) bo[i] = hash::BucketOf(w[2 * i], w[2 * i + 1], buckets);
  });
  const int64_t threads = CpuPoolThreads();
  const int64_t parts = n < kParallelIds ? 1 : (threads < buckets ? threads : buckets);
  const PartIds split = SplitByPart(bo, n, buckets, parts);
  std::vector<int64_t> part_counts(static_cast<size_t>(parts * abi::kNumHashCounts), 0);
  ParallelFor(pool, parts, 1, [&](int64_t p0, int64_t p1) {  // a part per chunk
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t at = split.start[p];
      InsertRun(t, w, bo, split.pos.data() + at, split.start[p + 1] - at, out, fr,
                part_counts.data() + p * abi::kNumHashCounts);
    }
  });
  for (int64_t j = 0; j < abi::kNumHashCounts; ++j) {
    int64_t total = 0;
    for (int64_t p = 0; p < parts; ++p) total += part_counts[p * abi::kNumHashCounts + j];
    cnt[j] = static_cast<int32_t>(total);
  }
}

// The workspace operand is the CUDA kernel's scratch (one unused byte here).
ffi::Error HashFindOrInsertCpu(ffi::ThreadPool pool, const HashFindOrInsertOperands& o) {
  CopyIfNotAliased(o.keys_out.untyped_data(), o.keys.untyped_data(), o.keys.size_bytes());
  CopyIfNotAliased(o.scores_out.untyped_data(), o.scores.untyped_data(), o.scores.size_bytes());
  CopyIfNotAliased(o.cand_keys_out.untyped_data(), o.cand_keys.untyped_data(),
                   o.cand_keys.size_bytes());
  CopyIfNotAliased(o.cand_scores_out.untyped_data(), o.cand_scores.untyped_data(),
                   o.cand_scores.size_bytes());
  const hash::Table t = hash::TableOver(o, *static_cast<const int32_t*>(o.step.untyped_data()));
  InsertAll(pool, t, static_cast<const uint32_t*>(o.ids.untyped_data()), o.ids.dimensions()[0],
            static_cast<int32_t*>(o.slots.untyped_data()),
            static_cast<bool*>(o.fresh.untyped_data()),
            static_cast<int32_t*>(o.counts.untyped_data()));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkHashFindCpu,
                              embark::CheckedHandler(embark::CheckHashFind, embark::HashFindCpu),
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  EMBARK_HASH_FIND_OPERANDS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkHashFindOrInsertCpu,
                              embark::CheckedHandler(embark::CheckHashFindOrInsert,
                                                     embark::HashFindOrInsertCpu),
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  EMBARK_HASH_FIND_OR_INSERT_OPERANDS);
