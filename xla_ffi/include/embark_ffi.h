// Shared helpers for the embark_jax XLA FFI kernels (CPU and CUDA bindings).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace embark {

namespace ffi = xla::ffi;

// bfloat16 <-> float on the host: a bf16 is the upper 16 bits of an IEEE float.
inline float Bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// How the CPU kernels store a bfloat16 (the Bf16 argument of DispatchFloat on the CPU).
using HostBf16 = uint16_t;

// Element access for the float types a kernel accepts: float (F32) or bf16 stored as uint16.
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static inline float Load(const float* p, int64_t i) { return p[i]; }
  static inline void Store(float* p, int64_t i, float v) { p[i] = v; }
};
template <>
struct Elem<uint16_t> {
  static inline float Load(const uint16_t* p, int64_t i) { return Bf16ToFloat(p[i]); }
  static inline void Store(uint16_t* p, int64_t i, float v) { p[i] = FloatToBf16(v); }
};

// Reads element i of an integer id buffer (S32 or S64) as int64.
inline int64_t LoadId(const ffi::AnyBuffer& ids, int64_t i) {
  if (ids.element_type() == ffi::DataType::S64) {
    return static_cast<const int64_t*>(ids.untyped_data())[i];
  }
  return static_cast<const int32_t*>(ids.untyped_data())[i];
}

inline bool IsIdType(ffi::DataType t) { return t == ffi::DataType::S32 || t == ffi::DataType::S64; }
inline bool IsFloatType(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

inline ffi::Error InvalidArgument(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "embark_jax: " + msg);
}

// Runs fn(begin, end) over [0, n) in chunks on XLA's intra-op thread pool. The calling thread
// takes chunks too, so the call completes even if no pool thread ever runs (no deadlock when
// XLA itself runs us on a pool thread). State is shared-owned: a task scheduled late finds no
// chunk left and only touches the shared state, never the caller's stack.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t min_chunk, Fn fn) {
  if (n <= 0) return;
  int64_t threads = pool.num_threads();
  int64_t max_tasks = (n + min_chunk - 1) / min_chunk;
  int64_t tasks = threads < 1 ? 1 : (threads + 1 < max_tasks ? threads + 1 : max_tasks);
  if (tasks <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  int64_t chunks = tasks * 4 < max_tasks ? tasks * 4 : max_tasks;
  int64_t chunk = (n + chunks - 1) / chunks;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  // fn is copied into the shared lambda so that late tasks never reference a dead frame.
  auto work = std::make_shared<Fn>(fn);
  auto run = [state, work, chunks, chunk, n]() {
    for (;;) {
      int64_t c = state->next.fetch_add(1);
      if (c >= chunks) return;
      int64_t b = c * chunk;
      int64_t e = b + chunk < n ? b + chunk : n;
      if (b < e) (*work)(b, e);
      if (state->done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  for (int64_t t = 1; t < tasks; ++t) pool.Schedule([run]() { run(); });
  run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() >= chunks; });
}

inline void Prefetch(const void* p) { __builtin_prefetch(p, 0, 1); }

}  // namespace embark
