// Host-side dedup helpers shared by the CPU kernels: an LSD radix sort of (id, position)
// pairs and the run structure of the sorted ids.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "embark_ffi.h"  // ParallelFor

namespace embark {

// A heap array left uninitialised: a std::vector zero-fills, which for the sort's four
// arrays of 131072 ids was 4 MB of stores before any work.
// Work memory of the CPU kernels, kept from call to call: a block released here is handed
// to the next call that needs at most its size, instead of going back to the system. A
// kernel's O(ids) work arrays (the sort's keys, positions and run starts, ~40 bytes an id)
// would otherwise be fresh pages on every call, each first touch a page fault that zeroes
// 4 KiB: for a million ids about 10,000 faults a call. One cache per process, shared by
// every thread; it keeps at most kKept blocks (the largest), so what it holds is bounded by
// the few blocks concurrent calls need at once, O(ids), never O(table).
class ScratchCache {
 public:
  static constexpr size_t kKept = 12;

  static ScratchCache& Get() {
    static ScratchCache* cache = new ScratchCache();  // never destroyed: used at exit too
    return *cache;
  }

  // A block of at least `bytes`, 64-byte aligned; its size goes to `*got`.
  void* Acquire(size_t bytes, size_t* got) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = blocks_.size();
      for (size_t i = 0; i < blocks_.size(); ++i) {
        if (blocks_[i].bytes >= bytes && (best == blocks_.size() ||
                                          blocks_[i].bytes < blocks_[best].bytes)) {
          best = i;
        }
      }
      if (best < blocks_.size()) {
        Block b = blocks_[best];
        blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(best));
        *got = b.bytes;
        return b.p;
      }
    }
    *got = bytes < 64 ? 64 : (bytes + 63) / 64 * 64;
    return ::operator new(*got, std::align_val_t{64});
  }

  // Returns a block from Acquire; the smallest go back to the system past kKept.
  void Release(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.push_back(Block{p, bytes});
    if (blocks_.size() <= kKept) return;
    auto smallest = std::min_element(blocks_.begin(), blocks_.end(),
                                     [](const Block& a, const Block& b) { return a.bytes < b.bytes; });
    ::operator delete(smallest->p, std::align_val_t{64});
    blocks_.erase(smallest);
  }

 private:
  struct Block {
    void* p;
    size_t bytes;
  };
  std::mutex mu_;
  std::vector<Block> blocks_;
};

// An uninitialised array of trivially copyable T in ScratchCache memory.
template <typename T>
class RawArray {
 public:
  RawArray() = default;
  explicit RawArray(int64_t n) : n_(n) {
    size_t want = sizeof(T) * static_cast<size_t>(n > 0 ? n : 1);
    p_ = static_cast<T*>(ScratchCache::Get().Acquire(want, &bytes_));
  }
  RawArray(RawArray&& o) noexcept { swap(o); }
  RawArray& operator=(RawArray&& o) noexcept {
    swap(o);
    return *this;
  }
  RawArray(const RawArray&) = delete;
  RawArray& operator=(const RawArray&) = delete;
  ~RawArray() {
    if (p_ != nullptr) ScratchCache::Get().Release(p_, bytes_);
  }
  T& operator[](int64_t i) { return p_[i]; }
  const T& operator[](int64_t i) const { return p_[i]; }
  int64_t size() const { return n_; }
  void truncate(int64_t n) { n_ = n; }  // keeps the allocation
  void swap(RawArray& o) {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(bytes_, o.bytes_);
  }

 private:
  T* p_ = nullptr;
  int64_t n_ = 0;
  size_t bytes_ = 0;
};

struct SortedIds {
  RawArray<uint64_t> keys;
  RawArray<int64_t> positions;
};

namespace sort_detail {

constexpr int kDigit = 11;  // 2048 buckets: counters in L1, write fronts in L2
constexpr int64_t kBuckets = int64_t{1} << kDigit;

inline int BitsOf(uint64_t x) {
  int bits = 0;
  while (bits < 64 && (x >> bits) != 0) ++bits;
  return bits;
}

// Bucket starts of digit (v >> shift) & (kBuckets - 1) over v[0, m), in `count`.
template <typename V>
void BucketStarts(const V& v, int64_t m, int shift, std::vector<int64_t>& count) {
  std::fill(count.begin(), count.end(), 0);
  for (int64_t i = 0; i < m; ++i) ++count[(v[i] >> shift) & (kBuckets - 1)];
  int64_t sum = 0;
  for (int64_t b = 0; b < kBuckets; ++b) {
    const int64_t c = count[b];
    count[b] = sum;
    sum += c;
  }
}

// Narrow ids: values key << 32 | position, sorted on their key bits (32 + [0, bits)).
inline SortedIds SortPacked(RawArray<uint64_t>& v, int bits) {
  const int64_t m = v.size();
  RawArray<uint64_t> tmp(m);
  std::vector<int64_t> count(kBuckets);
  for (int shift = 32; shift < 32 + bits; shift += kDigit) {
    BucketStarts(v, m, shift, count);
    for (int64_t i = 0; i < m; ++i) tmp[count[(v[i] >> shift) & (kBuckets - 1)]++] = v[i];
    v.swap(tmp);
  }
  SortedIds s{RawArray<uint64_t>(m), RawArray<int64_t>(m)};
  for (int64_t j = 0; j < m; ++j) {
    s.keys[j] = v[j] >> 32;
    s.positions[j] = static_cast<int64_t>(v[j] & 0xffffffffu);
  }
  return s;
}

// Below this many elements, or when one digit covers every key, SortPacked's passes over the
// whole array are cheaper than SortPackedBuckets' bucket bookkeeping.
constexpr int64_t kBucketsMin = int64_t{1} << 14;
constexpr int kLowDigit = 8;  // the in-bucket passes: 256 counters, cleared per bucket

// Sorts one bucket's packed values a[0, len) on key bits [32, 32 + low_bits), w[0, len) the
// other buffer; returns the one that holds the sorted values.
inline uint64_t* SortBucket(uint64_t* a, uint64_t* w, int64_t len, int low_bits) {
  int64_t count[int64_t{1} << kLowDigit];
  for (int shift = 32; shift < 32 + low_bits && len > 1; shift += kLowDigit) {
    const int width = std::min(kLowDigit, 32 + low_bits - shift);
    const uint64_t mask = (uint64_t{1} << width) - 1;
    std::fill(count, count + (int64_t{1} << width), 0);
    for (int64_t i = 0; i < len; ++i) ++count[(a[i] >> shift) & mask];
    int64_t sum = 0;
    for (int64_t b = 0; b < (int64_t{1} << width); ++b) {
      const int64_t c = count[b];
      count[b] = sum;
      sum += c;
    }
    for (int64_t i = 0; i < len; ++i) w[count[(a[i] >> shift) & mask]++] = a[i];
    std::swap(a, w);
  }
  return a;
}

// Narrow ids with more than one digit of key bits, many of them: one pass over the whole
// array on the top digit scatters the values into buckets (stable), then each bucket is
// sorted on the remaining bits by passes that stay in cache, and unpacked, the buckets spread
// over the CPU workers. SortPacked instead makes every pass over the whole array, each one
// a scatter of a multi-MiB array into 2048 places, on one thread.
inline SortedIds SortPackedBuckets(RawArray<uint64_t>& v, int bits) {
  const int64_t m = v.size();
  const int low_bits = bits - kDigit;
  const int top_shift = 32 + low_bits;  // v >> top_shift < kBuckets: every key < 2^bits
  // The top-digit pass in `parts` contiguous parts, one per worker: each part counts its
  // values per bucket, then scatters them behind the earlier parts' (stable).
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(CpuPoolThreads(), m / kBucketsMin));
  const int64_t per = (m + parts - 1) / parts;
  std::vector<int64_t> front(static_cast<size_t>(parts * kBuckets), 0);
  ParallelFor(parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int64_t* c = &front[p * kBuckets];
      for (int64_t i = p * per, e = std::min(m, i + per); i < e; ++i) ++c[v[i] >> top_shift];
    }
  });
  std::vector<int64_t> start(kBuckets + 1, 0);
  int64_t sum = 0;
  for (int64_t b = 0; b < kBuckets; ++b) {
    start[b] = sum;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t c = front[p * kBuckets + b];
      front[p * kBuckets + b] = sum;
      sum += c;
    }
  }
  start[kBuckets] = sum;
  RawArray<uint64_t> tmp(m);
  ParallelFor(parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int64_t* f = &front[p * kBuckets];
      for (int64_t i = p * per, e = std::min(m, i + per); i < e; ++i) {
        tmp[f[v[i] >> top_shift]++] = v[i];
      }
    }
  });
  SortedIds s{RawArray<uint64_t>(m), RawArray<int64_t>(m)};
  ParallelFor(kBuckets, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = start[b], len = start[b + 1] - lo;
      const uint64_t* sorted = SortBucket(&tmp[lo], &v[lo], len, low_bits);
      for (int64_t i = 0; i < len; ++i) {
        s.keys[lo + i] = sorted[i] >> 32;
        s.positions[lo + i] = static_cast<int64_t>(sorted[i] & 0xffffffffu);
      }
    }
  });
  return s;
}

// Wide ids: the keys sorted with their positions carried alongside.
inline SortedIds SortWide(SortedIds s, int bits) {
  const int64_t m = s.keys.size();
  RawArray<uint64_t> k2(m);
  RawArray<int64_t> p2(m);
  std::vector<int64_t> count(kBuckets);
  for (int shift = 0; shift < bits; shift += kDigit) {
    BucketStarts(s.keys, m, shift, count);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t dst = count[(s.keys[i] >> shift) & (kBuckets - 1)]++;
      k2[dst] = s.keys[i];
      p2[dst] = s.positions[i];
    }
    s.keys.swap(k2);
    s.positions.swap(p2);
  }
  return s;
}

}  // namespace sort_detail

// Sorts the positions of the valid (>= 0) ids by id (stable), returning them with the sorted
// keys. Only as many 11-bit digit passes as the largest id needs; with many ids and more than
// one digit, one pass on the top digit then passes inside each bucket (SortPackedBuckets).
// Ids and positions that fit
// 32 bits (every int32 id) are sorted packed, id << 32 | position, 8 bytes an element: half
// the traffic of separate key and position arrays (docs/benchmarks.md has the measurements).
template <typename LoadFn>
SortedIds SortValidIds(int64_t n, LoadFn load) {
  constexpr uint64_t kNarrow = uint64_t{1} << 32;
  uint64_t max_key = 0;
  int64_t m = 0;
  if (n <= static_cast<int64_t>(kNarrow)) {
    RawArray<uint64_t> packed(n);
    bool wide = false;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = load(i);
      if (id < 0) continue;
      const uint64_t key = static_cast<uint64_t>(id);
      if (key >= kNarrow) {
        wide = true;  // sorted below instead
        break;
      }
      max_key = key > max_key ? key : max_key;
      packed[m++] = key << 32 | static_cast<uint64_t>(i);
    }
    if (!wide) {
      packed.truncate(m);
      const int bits = sort_detail::BitsOf(max_key);
      if (bits > sort_detail::kDigit && m >= sort_detail::kBucketsMin) {
        return sort_detail::SortPackedBuckets(packed, bits);
      }
      return sort_detail::SortPacked(packed, bits);
    }
  }
  SortedIds s{RawArray<uint64_t>(n), RawArray<int64_t>(n)};
  m = 0;
  max_key = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = load(i);
    if (id < 0) continue;
    s.keys[m] = static_cast<uint64_t>(id);
    s.positions[m++] = i;
    max_key = static_cast<uint64_t>(id) > max_key ? static_cast<uint64_t>(id) : max_key;
  }
  s.keys.truncate(m);
  s.positions.truncate(m);
  return sort_detail::SortWide(std::move(s), sort_detail::BitsOf(max_key));
}

// Start offset of each run of equal keys in sorted order, plus a final sentinel (= size).
// Branch-free: with mostly distinct ids a branch per key mispredicted half the time.
inline RawArray<int64_t> RunStarts(const RawArray<uint64_t>& keys) {
  const int64_t m = keys.size();
  RawArray<int64_t> at(m + 1);
  int64_t u = 0;
  for (int64_t i = 0; i < m; ++i) {
    at[u] = i;
    u += (i == 0 || keys[i] != keys[i - 1]) ? 1 : 0;
  }
  at[u] = m;
  at.truncate(u + 1);
  return at;
}

}  // namespace embark
