// Host-side dedup helpers shared by the CPU kernels: an LSD radix sort of (id, position)
// pairs and the run structure of the sorted ids.
#pragma once

#include <cstdint>
#include <vector>

namespace embark {

// Sorts the positions of the valid (>= 0) ids by id (stable), returning them with the sorted
// keys. Only as many 11-bit digit passes as the largest id needs.
struct SortedIds {
  std::vector<uint64_t> keys;     // sorted ids
  std::vector<int64_t> positions; // original position of each sorted id
};

template <typename LoadFn>
SortedIds SortValidIds(int64_t n, LoadFn load) {
  SortedIds s;
  s.keys.reserve(n);
  s.positions.reserve(n);
  uint64_t max_key = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t id = load(i);
    if (id < 0) continue;
    s.keys.push_back(static_cast<uint64_t>(id));
    s.positions.push_back(i);
    if (static_cast<uint64_t>(id) > max_key) max_key = static_cast<uint64_t>(id);
  }
  const int64_t m = static_cast<int64_t>(s.keys.size());
  int bits = 0;
  while (bits < 64 && (max_key >> bits) != 0) ++bits;
  constexpr int kDigit = 11;
  constexpr int kBuckets = 1 << kDigit;
  std::vector<uint64_t> k2(m);
  std::vector<int64_t> p2(m);
  std::vector<int64_t> count(kBuckets);
  for (int shift = 0; shift < bits; shift += kDigit) {
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < m; ++i) ++count[(s.keys[i] >> shift) & (kBuckets - 1)];
    int64_t sum = 0;
    for (int b = 0; b < kBuckets; ++b) {
      int64_t c = count[b];
      count[b] = sum;
      sum += c;
    }
    for (int64_t i = 0; i < m; ++i) {
      int64_t dst = count[(s.keys[i] >> shift) & (kBuckets - 1)]++;
      k2[dst] = s.keys[i];
      p2[dst] = s.positions[i];
    }
    s.keys.swap(k2);
    s.positions.swap(p2);
  }
  return s;
}

// Start offset of each run of equal keys in sorted order, plus a final sentinel (= size).
inline std::vector<int64_t> RunStarts(const std::vector<uint64_t>& keys) {
  std::vector<int64_t> starts;
  const int64_t m = static_cast<int64_t>(keys.size());
  for (int64_t i = 0; i < m; ++i) {
    if (i == 0 || keys[i] != keys[i - 1]) starts.push_back(i);
  }
  starts.push_back(m);
  return starts;
}

}  // namespace embark
