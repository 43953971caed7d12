// Dedup on CUDA (CUB radix sort in the workspace): sorted unique ids, inverse, counts and the
// true distinct count (overflow = num_unique - capacity, reported by the caller).
#include "dedup.cuh"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

__global__ void UniqueOutputs(DedupView v, bool ids64, int64_t n, int64_t cap, void* unique,
                              int32_t* inverse, int32_t* counts) {
  const int64_t u = *v.num_unique;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t k = tid; k < cap; k += stride) {
    const bool has = k < u;
    const int64_t id = has ? SortedId(v, ids64, v.run_start[k]) : -1;
    if (ids64) static_cast<int64_t*>(unique)[k] = id;
    else static_cast<int32_t*>(unique)[k] = static_cast<int32_t>(id);
    counts[k] = has ? v.run_start[k + 1] - v.run_start[k] : 0;
  }
  for (int64_t t = tid; t < n; t += stride) {
    const int32_t slot = v.slot[t];
    inverse[v.positions[t]] = (slot >= 0 && slot < cap) ? slot : -1;
  }
}

ffi::Error UniqueCudaImpl(cudaStream_t stream, ffi::AnyBuffer ids,
                          ffi::Result<ffi::AnyBuffer> unique,
                          ffi::Result<ffi::Buffer<ffi::S32>> inverse,
                          ffi::Result<ffi::Buffer<ffi::S32>> counts,
                          ffi::Result<ffi::Buffer<ffi::S32>> num_unique,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  ffi::Error err = CheckUnique(ids, *unique, *inverse, *counts, *num_unique);
  if (err.failure()) return err;
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int64_t cap = static_cast<int64_t>(unique->element_count());
  const bool ids64 = ids.element_type() == ffi::DataType::S64;
  DedupView v;
  err = RunDedup(stream, ids.untyped_data(), ids64, n, /*vocab=*/0, /*d=*/0,
                 workspace->untyped_data(), workspace->size_bytes(), num_unique->typed_data(),
                 &v);
  if (err.failure()) return err;
  const int64_t work = n > cap ? n : cap;
  UniqueOutputs<<<GridFor(work, 256), 256, 0, stream>>>(v, ids64, n, cap, unique->untyped_data(),
                                                       inverse->typed_data(), counts->typed_data());
  return CudaStatus("unique");
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkUniqueCuda, embark::UniqueCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>(),  // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});
