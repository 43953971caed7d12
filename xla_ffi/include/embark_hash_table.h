// The hash table of a dynamic embedding table (docs/design.md §11): its layout, the rules of
// find and find_or_insert for one id, and the operand contract of the two FFI targets. The
// CPU (cpu/hash_table.cc) and CUDA (cuda/hash_table.cu) handlers both run the functions
// below, so both backends apply the same rules by construction; the jnp reference
// (embark_jax/ops/hash_reference.py) and the Python model (tests/hash_table_model.py) are
// written from the same description and checked against the kernels bit for bit.
//
// Layout (one shard): B buckets of S slots, capacity C = B * S; slot e = b * S + j is row e
// of the table's values and optimizer slots.
//   keys        [C, 2] uint32  the id of each slot as (lo, hi) words; (~0, ~0) = empty
//   scores      [C, 2] int32   (last step the id was seen, times seen), int32 saturating
//   cand_keys   [B * A, 2] uint32  admission candidates: A per bucket, ids not admitted yet
//   cand_scores [B * A, 2] int32   (last step seen, times seen) of each candidate
// An entry is live when its key is not empty and, with a ttl > 0, step - last <= ttl.
//
// find_or_insert processes the ids in order, as if one at a time (the kernels parallelise
// over buckets, which never interact, so the result is the sequential one):
//   1. padding (~0, ~0): slot -1, nothing counted.
//   2. a live entry of the bucket holds the id: FOUND, its score becomes (step, times + 1).
//   3. admission (threshold T > 1): the id's live candidate entry counts the sighting (or the
//      id takes the first free candidate slot, else replaces the candidate seen longest ago,
//      ties: the fewest sightings, then the lowest position). Fewer than T sightings:
//      REFUSED, slot -1.
//   4. insert into the first free slot (empty or expired; EXPIRED if expired), else, unless
//      the policy is NONE, replace the entry with the lowest score among those not seen in
//      this step (LRU: last step; LFU: times seen, then last step; then the lowest position):
//      EVICTED. Nothing to take: DROPPED, slot -1 (the candidate keeps its count). Inserted:
//      INSERTED, score (step, sightings), the candidate slot is emptied, `fresh` is set.
// Entries seen in the current step are never evicted, so every slot returned during a step
// keeps its id until the step ends. Nothing ever empties a slot of the main table, so the
// occupied slots of a bucket are a prefix: a scan may stop at the first empty slot.
#pragma once

#include <cstdint>
#include <string>

#include "embark_abi.h"
#include "embark_check.h"
#include "embark_ffi.h"

namespace embark {
namespace hash {

constexpr uint32_t kEmptyWord = 0xffffffffu;
constexpr int32_t kMaxCount = 0x7fffffff;

// The table as the per-id functions see it (device or host pointers alike).
struct Table {
  uint32_t* keys;
  int32_t* scores;
  uint32_t* cand_keys;
  int32_t* cand_scores;
  int64_t num_buckets, bucket_size, candidates;  // B, S, A
  int64_t threshold, ttl;                        // T >= 1; ttl 0 = entries never expire
  int64_t eviction;                              // abi::Eviction
  int32_t step;
};

// Rows of a [..., R, 2] word-pair array (keys, scores, candidates): its leading dimensions
// all count, so a shard_map block [1, C, 2] is updated as it is (a reshape would make XLA
// copy the aliased buffer).
template <typename B>
inline int64_t PairRows(const B& b) {
  return static_cast<int64_t>(b.element_count()) / 2;
}

}  // namespace hash

// embark_hash_find's operands, in EMBARK_HASH_FIND_OPERANDS' order (CheckedHandler).
struct HashFindOperands {
  ffi::AnyBuffer keys, scores, ids, step;
  ffi::AnyBuffer slots;
  int64_t bucket_size, ttl;
};

// embark_hash_find_or_insert's operands, in EMBARK_HASH_FIND_OR_INSERT_OPERANDS' order.
struct HashFindOrInsertOperands {
  ffi::AnyBuffer keys, scores, cand_keys, cand_scores, ids, step;
  ffi::AnyBuffer keys_out, scores_out, cand_keys_out, cand_scores_out;
  ffi::AnyBuffer slots, fresh, counts, workspace;
  int64_t bucket_size, eviction, threshold, ttl;
};

namespace hash {

// The table over find_or_insert's outputs (they alias its inputs: the kernels update them in
// place); the candidate count comes from the candidate buffer [B * A, 2].
inline Table TableOver(const HashFindOrInsertOperands& o, int32_t step) {
  const int64_t buckets = PairRows(o.keys_out) / o.bucket_size;
  return Table{static_cast<uint32_t*>(o.keys_out.untyped_data()),
               static_cast<int32_t*>(o.scores_out.untyped_data()),
               static_cast<uint32_t*>(o.cand_keys_out.untyped_data()),
               static_cast<int32_t*>(o.cand_scores_out.untyped_data()),
               buckets,
               o.bucket_size,
               PairRows(o.cand_keys_out) / buckets,
               o.threshold,
               o.ttl,
               o.eviction,
               step};
}

EMBARK_HOST_DEVICE inline bool IsEmpty(uint32_t lo, uint32_t hi) {
  return lo == kEmptyWord && hi == kEmptyWord;
}

EMBARK_HOST_DEVICE inline int64_t BucketOf(uint32_t lo, uint32_t hi, int64_t num_buckets) {
  uint32_t h0, h1;
  abi::HashKey(lo, hi, &h0, &h1);
  return static_cast<int64_t>(h0 % static_cast<uint32_t>(num_buckets));
}

// Not expired (for a non-empty entry last seen at `last`).
EMBARK_HOST_DEVICE inline bool Unexpired(int32_t last, int32_t step, int64_t ttl) {
  return ttl <= 0 || static_cast<int64_t>(step) - static_cast<int64_t>(last) <= ttl;
}

// The slot of (lo, hi)'s live entry in bucket b, or -1. Stops at the first empty slot (the
// occupied slots are a prefix). Padding finds nothing.
EMBARK_HOST_DEVICE inline int64_t FindInBucket(const uint32_t* keys, const int32_t* scores,
                                               int64_t b, int64_t bucket_size, uint32_t lo,
                                               uint32_t hi, int32_t step, int64_t ttl) {
  if (IsEmpty(lo, hi)) return -1;
  const int64_t base = b * bucket_size;
  for (int64_t j = 0; j < bucket_size; ++j) {
    const uint32_t klo = keys[2 * (base + j)], khi = keys[2 * (base + j) + 1];
    if (klo == lo && khi == hi) {
      if (Unexpired(scores[2 * (base + j)], step, ttl)) return base + j;
    } else if (IsEmpty(klo, khi)) {
      return -1;
    }
  }
  return -1;
}

EMBARK_HOST_DEVICE inline int32_t SatInc(int32_t x) { return x < kMaxCount ? x + 1 : x; }

// Counts the sighting of (lo, hi) among bucket b's admission candidates; returns the slot of
// its candidate entry (now holding the count) and the count.
EMBARK_HOST_DEVICE inline int64_t CountCandidate(const Table& t, int64_t b, uint32_t lo,
                                                 uint32_t hi, int32_t* count) {
  const int64_t base = b * t.candidates;
  int64_t free_slot = -1, victim = -1;
  for (int64_t j = 0; j < t.candidates; ++j) {
    const int64_t e = base + j;
    const uint32_t klo = t.cand_keys[2 * e], khi = t.cand_keys[2 * e + 1];
    const int32_t last = t.cand_scores[2 * e], seen = t.cand_scores[2 * e + 1];
    const bool live = !IsEmpty(klo, khi) && Unexpired(last, t.step, t.ttl);
    if (live && klo == lo && khi == hi) {
      *count = SatInc(seen);
      t.cand_scores[2 * e] = t.step;
      t.cand_scores[2 * e + 1] = *count;
      return e;
    }
    if (!live) {
      if (free_slot < 0) free_slot = e;
    } else if (victim < 0 || last < t.cand_scores[2 * victim] ||
               (last == t.cand_scores[2 * victim] && seen < t.cand_scores[2 * victim + 1])) {
      victim = e;
    }
  }
  const int64_t e = free_slot >= 0 ? free_slot : victim;
  t.cand_keys[2 * e] = lo;
  t.cand_keys[2 * e + 1] = hi;
  t.cand_scores[2 * e] = t.step;
  t.cand_scores[2 * e + 1] = 1;
  *count = 1;
  return e;
}

// Whether entry (last_a, seen_a) should be evicted before (last_b, seen_b) under `eviction`
// (strictly lower score; equal scores keep the lower position).
EMBARK_HOST_DEVICE inline bool EvictsBefore(int64_t eviction, int32_t last_a, int32_t seen_a,
                                            int32_t last_b, int32_t seen_b) {
  if (eviction == static_cast<int64_t>(abi::Eviction::LFU) && seen_a != seen_b) {
    return seen_a < seen_b;
  }
  return last_a < last_b;
}

// find_or_insert of one id (lo, hi) of bucket b: returns its slot or -1, adds to counts
// (abi::HashCount order) and sets *fresh when it inserted. Reads the keys up to the id or the
// first empty slot, and the scores only where needed: the id's own, the expired ones' (with a
// ttl), and every entry's when a full bucket must choose a victim.
EMBARK_HOST_DEVICE inline int64_t FindOrInsertOne(const Table& t, int64_t b, uint32_t lo,
                                                  uint32_t hi, int64_t* counts, bool* fresh) {
  *fresh = false;
  if (IsEmpty(lo, hi)) return -1;
  uint32_t* const keys = t.keys;
  int32_t* const scores = t.scores;
  const int64_t size = t.bucket_size, ttl = t.ttl, eviction = t.eviction;
  const int32_t step = t.step;
  const int64_t base = b * size;
  int64_t end = size;  // the occupied slots are [0, end): a prefix
  for (int64_t j = 0; j < size; ++j) {
    const int64_t e = base + j;
    const uint32_t klo = keys[2 * e], khi = keys[2 * e + 1];
    if (klo == lo && khi == hi) {
      if (Unexpired(scores[2 * e], step, ttl)) {
        scores[2 * e] = step;
        scores[2 * e + 1] = SatInc(scores[2 * e + 1]);
        counts[static_cast<int64_t>(abi::HashCount::FOUND)] += 1;
        return e;
      }
    } else if (IsEmpty(klo, khi)) {
      end = j;
      break;
    }
  }
  int32_t seen = 1;
  int64_t cand = -1;
  if (t.threshold > 1) {
    cand = CountCandidate(t, b, lo, hi, &seen);
    if (seen < t.threshold) {
      counts[static_cast<int64_t>(abi::HashCount::REFUSED)] += 1;
      return -1;
    }
  }
  // The first free slot: an expired entry, else the first empty slot.
  int64_t e = -1;
  if (ttl > 0) {
    for (int64_t j = 0; j < end; ++j) {
      if (!Unexpired(scores[2 * (base + j)], step, ttl)) {
        e = base + j;
        counts[static_cast<int64_t>(abi::HashCount::EXPIRED)] += 1;
        break;
      }
    }
  }
  if (e < 0 && end < size) e = base + end;
  if (e < 0 && eviction != static_cast<int64_t>(abi::Eviction::NONE)) {
    // A full bucket of live entries: the lowest score among those not seen in this step.
    int32_t v_last = 0, v_seen = 0;
    for (int64_t j = 0; j < size; ++j) {
      const int32_t last = scores[2 * (base + j)], s = scores[2 * (base + j) + 1];
      if (last < step && (e < 0 || EvictsBefore(eviction, last, s, v_last, v_seen))) {
        e = base + j;
        v_last = last;
        v_seen = s;
      }
    }
    if (e >= 0) counts[static_cast<int64_t>(abi::HashCount::EVICTED)] += 1;
  }
  if (e < 0) {
    counts[static_cast<int64_t>(abi::HashCount::DROPPED)] += 1;
    return -1;
  }
  keys[2 * e] = lo;
  keys[2 * e + 1] = hi;
  scores[2 * e] = step;
  scores[2 * e + 1] = seen;
  if (cand >= 0) {
    t.cand_keys[2 * cand] = kEmptyWord;
    t.cand_keys[2 * cand + 1] = kEmptyWord;
    t.cand_scores[2 * cand] = 0;
    t.cand_scores[2 * cand + 1] = 0;
  }
  counts[static_cast<int64_t>(abi::HashCount::INSERTED)] += 1;
  *fresh = true;
  return e;
}

// The cache lines of bucket b's keys (at most 8), for a probe to come.
inline void PrefetchBucket(const uint32_t* keys, int64_t b, int64_t bucket_size) {
  const char* p = reinterpret_cast<const char*>(keys + 2 * b * bucket_size);
  const int64_t bytes = 8 * bucket_size;
  for (int64_t off = 0; off < bytes && off < 512; off += 64) __builtin_prefetch(p + off, 0, 1);
}

}  // namespace hash

// --- Operand contracts (CPU and CUDA handlers) ---------------------------------------------

// A word-pair state array: rank >= 2 ([..., C, 2], leading dimensions count as rows: see
// PairRows), its last dimension 2.
inline Check& PairArray(Check& c, const char* name, const ffi::AnyBuffer& b, const char* what) {
  if (b.dimensions().size() < 2) return c.Rank(name, b, 2, "[..., C, 2]");
  return c.Dim(name, b, b.dimensions().size() - 1, 2, what);
}

// The table operands shared by both targets: keys [..., C, 2] uint32, scores of its shape
// int32, ids [N, 2] uint32, step [] int32, slots [N] int32; bucket_size divides C; ttl >= 0.
inline void CheckHashTableOperands(Check& c, const ffi::AnyBuffer& keys,
                                   const ffi::AnyBuffer& scores, const ffi::AnyBuffer& ids,
                                   const ffi::AnyBuffer& step, const ffi::AnyBuffer& slots) {
  PairArray(c, "keys", keys, "the (lo, hi) words of each id")
      .Type("keys", keys.element_type(), ffi::DataType::U32)
      .SameShape("scores", scores, keys, "one (last step, times seen) per slot")
      .Type("scores", scores.element_type(), ffi::DataType::S32)
      .Rank("ids", ids, 2, "[N, 2]")
      .Dim("ids", ids, 1, 2, "the (lo, hi) words of each id")
      .Type("ids", ids.element_type(), ffi::DataType::U32)
      .Count("step", step, 1, "a scalar")
      .Type("step", step.element_type(), ffi::DataType::S32);
  if (c.failed()) return;
  c.Count("slots", slots, ids.dimensions()[0], "[N], one per id")
      .Type("slots", slots.element_type(), ffi::DataType::S32);
}

inline ffi::Error CheckHashAttrs(const char* kernel, const ffi::AnyBuffer& keys,
                                 int64_t bucket_size, int64_t ttl) {
  const int64_t cap = hash::PairRows(keys);
  if (bucket_size < 1 || cap % bucket_size != 0 || cap == 0) {
    return InvalidArgument(std::string(kernel) + ": attribute bucket_size must be >= 1 and " +
                           "divide the capacity " + std::to_string(cap) + " (> 0), got " +
                           std::to_string(bucket_size));
  }
  if (cap > 0x7fffffffLL) {
    return InvalidArgument(std::string(kernel) + ": keys must have < 2^31 slots (int32 slots), "
                           "got " + std::to_string(cap));
  }
  if (ttl < 0) {
    return InvalidArgument(std::string(kernel) + ": attribute ttl must be >= 0 (0: none), got " +
                           std::to_string(ttl));
  }
  return ffi::Error::Success();
}

// embark_hash_find: the table operands.
inline ffi::Error CheckHashFind(const HashFindOperands& o) {
  Check c("hash_find");
  CheckHashTableOperands(c, o.keys, o.scores, o.ids, o.step, o.slots);
  if (c.failed()) return c.error();
  return CheckHashAttrs("hash_find", o.keys, o.bucket_size, o.ttl);
}

// find_or_insert's other arrays: cand_keys [B * A, 2] uint32 and cand_scores of its shape
// int32; the four state outputs of their inputs' shapes (aliased); fresh bool; counts
// [kNumHashCounts] int32; and the eviction attribute.
inline void CheckInsertArrays(Check& c, const HashFindOrInsertOperands& o) {
  PairArray(c, "cand_keys", o.cand_keys, "the (lo, hi) words of each candidate")
      .Type("cand_keys", o.cand_keys.element_type(), ffi::DataType::U32)
      .SameShape("cand_scores", o.cand_scores, o.cand_keys, "one score per candidate")
      .Type("cand_scores", o.cand_scores.element_type(), ffi::DataType::S32)
      .SameShape("keys output", o.keys_out, o.keys, "the keys': updated in place")
      .Type("keys output", o.keys_out.element_type(), ffi::DataType::U32)
      .SameShape("scores output", o.scores_out, o.scores, "the scores': updated in place")
      .Type("scores output", o.scores_out.element_type(), ffi::DataType::S32)
      .SameShape("cand_keys output", o.cand_keys_out, o.cand_keys,
                 "cand_keys': updated in place")
      .Type("cand_keys output", o.cand_keys_out.element_type(), ffi::DataType::U32)
      .SameShape("cand_scores output", o.cand_scores_out, o.cand_scores,
                 "cand_scores': updated in place")
      .Type("cand_scores output", o.cand_scores_out.element_type(), ffi::DataType::S32)
      .Type("fresh", o.fresh.element_type(), ffi::DataType::PRED)
      .Type("counts", o.counts.element_type(), ffi::DataType::S32)
      .Count("counts", o.counts, abi::kNumHashCounts, "one per ABI hash count")
      .Attr("eviction", o.eviction, abi::kEvictionNames, abi::kNumEvictions);
}

// threshold >= 1, and A candidates per bucket: cand_keys' rows a multiple of the B buckets,
// at least one per bucket when threshold > 1.
inline ffi::Error CheckCandidates(const char* k, const HashFindOrInsertOperands& o) {
  const int64_t buckets = hash::PairRows(o.keys) / o.bucket_size;
  const int64_t cands = hash::PairRows(o.cand_keys);
  if (o.threshold < 1) {
    return InvalidArgument(std::string(k) + ": attribute threshold must be >= 1, got " +
                           std::to_string(o.threshold));
  }
  if (cands % buckets != 0 || (o.threshold > 1 && cands == 0)) {
    return InvalidArgument(std::string(k) + ": cand_keys must have a multiple of the " +
                           std::to_string(buckets) + " buckets as rows" +
                           (o.threshold > 1 ? " (at least one per bucket: threshold > 1)" : "") +
                           ", got " + std::to_string(cands));
  }
  return ffi::Error::Success();
}

// embark_hash_find_or_insert: the table operands, the arrays above, fresh [N], the attributes.
inline ffi::Error CheckHashFindOrInsert(const HashFindOrInsertOperands& o) {
  const char* k = "hash_find_or_insert";
  Check c(k);
  CheckHashTableOperands(c, o.keys, o.scores, o.ids, o.step, o.slots);
  CheckInsertArrays(c, o);
  if (c.failed()) return c.error();
  c.Count("fresh", o.fresh, o.ids.dimensions()[0], "[N], one per id");
  if (c.failed()) return c.error();
  ffi::Error err = CheckHashAttrs(k, o.keys, o.bucket_size, o.ttl);
  if (err.failure()) return err;
  return CheckCandidates(k, o);
}

}  // namespace embark
