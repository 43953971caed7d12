// Shared helpers for the embark_jax XLA FFI kernels (CPU and CUDA bindings).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "host_bf16.h"
#include "xla/ffi/api/ffi.h"

namespace embark {

namespace ffi = xla::ffi;

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

// The CPU kernels' worker pool (cpu/cpu_pool.cc; the CUDA module neither uses nor links it):
// the number of threads a job runs on (the caller included), and a call of fn(ctx, c) for
// every chunk c in [0, chunks) on them, returning when all are done.
int64_t CpuPoolThreads();
// Whether the workers stay awake after a job (EMBARK_CPU_SPIN; cpu_pool.cc).
void SetCpuSpin(bool on);
bool GetCpuSpin();
void CpuPoolRun(int64_t chunks, void (*fn)(void*, int64_t), void* ctx);

// Runs fn(begin, end) over [0, n) in chunks of at least min_chunk on the CPU worker pool
// (cpu_pool.cc explains why not XLA's intra-op pool). The calling thread takes chunks too.
template <typename Fn>
void ParallelFor(int64_t n, int64_t min_chunk, Fn fn) {
  if (n <= 0) return;
  const int64_t threads = CpuPoolThreads();
  const int64_t max_chunks = (n + min_chunk - 1) / min_chunk;
  const int64_t chunks = threads * 4 < max_chunks ? threads * 4 : max_chunks;
  if (threads <= 1 || chunks <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  struct Ctx {
    Fn* fn;
    int64_t chunk, n;
  } ctx{&fn, (n + chunks - 1) / chunks, n};
  CpuPoolRun(
      chunks,
      [](void* p, int64_t c) {
        const Ctx* x = static_cast<const Ctx*>(p);
        const int64_t b = c * x->chunk, e = b + x->chunk < x->n ? b + x->chunk : x->n;
        if (b < e) (*x->fn)(b, e);
      },
      &ctx);
}

// The same, with the handlers' context (XLA's intra-op pool, `pool`) kept in the signature.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t min_chunk, Fn fn) {
  (void)pool;
  ParallelFor(n, min_chunk, fn);
}

inline void Prefetch(const void* p) { __builtin_prefetch(p, 0, 1); }

// Prefetches every cache line of `bytes` bytes from p.
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

}  // namespace embark
