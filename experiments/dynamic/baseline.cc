// The std::unordered_map baseline of the dynamic-table benchmark (experiments/dynamic/).
// Built by bench.py with the system g++ at run time (-O3, baseline x86-64, as the kernels),
// one thread. The same keys as ours, the same operations:
//
//   find            key -> row, or -1 (map.find)
//   find_or_insert  key -> row; a new key takes the next free row, whose dim floats are
//                   zeroed (our table's `zeros` initializer); map.try_emplace
//
// The map starts with the keys our table holds (rows 0..P-1, reserved for the capacity); each
// timed find_or_insert runs on a fresh copy of it, made before the timer starts, as ours runs
// on a fresh copy of its table. Unlike ours it has no capacity, so it never evicts nor drops.
//
//   baseline <present.u64> <batch.u64> <capacity> <dim> <repeats>
//
// Prints one JSON object: the seconds of each repetition of each op, and checks (hits).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

std::vector<uint64_t> ReadKeys(const char* path) {
  std::vector<uint64_t> keys;
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot open %s\n", path);
    std::exit(2);
  }
  uint64_t k;
  while (std::fread(&k, sizeof(k), 1, f) == 1) keys.push_back(k);
  std::fclose(f);
  return keys;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string List(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%s%.9g", i ? ", " : "", v[i]);
    s += buf;
  }
  return s + "]";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s present.u64 batch.u64 capacity dim repeats\n", argv[0]);
    return 2;
  }
  const std::vector<uint64_t> present = ReadKeys(argv[1]);
  const std::vector<uint64_t> batch = ReadKeys(argv[2]);
  const int64_t capacity = std::stoll(argv[3]);
  const int64_t dim = std::stoll(argv[4]);
  const int repeats = std::stoi(argv[5]);
  const int64_t n = static_cast<int64_t>(batch.size());

  std::unordered_map<uint64_t, int32_t> map;
  map.reserve(static_cast<size_t>(capacity));
  for (size_t i = 0; i < present.size(); ++i) map.emplace(present[i], static_cast<int32_t>(i));
  // Rows for the table and for every insert of a batch (no capacity: it never evicts).
  std::vector<float> values(static_cast<size_t>((capacity + n) * dim), 1.0f);
  std::vector<int32_t> out(static_cast<size_t>(n));

  std::vector<double> find_s, insert_s;
  int64_t hits = 0, inserted = 0, checksum = 0;
  for (int r = 0; r < repeats + 1; ++r) {  // the first repetition warms up, untimed
    const double t0 = Now();
    for (int64_t i = 0; i < n; ++i) {
      auto it = map.find(batch[i]);
      out[i] = it == map.end() ? -1 : it->second;
    }
    const double t1 = Now();
    hits = 0;
    for (int64_t i = 0; i < n; ++i) hits += out[i] >= 0;
    if (r > 0) find_s.push_back(t1 - t0);

    std::unordered_map<uint64_t, int32_t> m = map;  // a fresh copy, outside the timer
    int32_t next = static_cast<int32_t>(present.size());
    const double t2 = Now();
    for (int64_t i = 0; i < n; ++i) {
      auto [it, is_new] = m.try_emplace(batch[i], next);
      if (is_new) {
        std::memset(values.data() + static_cast<size_t>(next) * dim, 0, sizeof(float) * dim);
        ++next;
      }
      out[i] = it->second;
    }
    const double t3 = Now();
    inserted = next - static_cast<int64_t>(present.size());
    for (int64_t i = 0; i < n; ++i) checksum += out[i];
    if (r > 0) insert_s.push_back(t3 - t2);
  }
  std::printf(
      "{\"find_s\": %s, \"find_or_insert_s\": %s, \"hits\": %lld, \"inserted\": %lld, "
      "\"size\": %zu, \"checksum\": %lld}\n",
      List(find_s).c_str(), List(insert_s).c_str(), static_cast<long long>(hits),
      static_cast<long long>(inserted), map.size(), static_cast<long long>(checksum));
  return 0;
}
