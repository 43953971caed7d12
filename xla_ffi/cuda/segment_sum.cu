// segment_sum on CUDA: one thread block row-strip per input row, atomics into the output.
// Segment ids outside [0, num_segments) are dropped. Output is zeroed on the stream first;
// no allocation and no host sync, so the handler is command-buffer (CUDA graph) compatible.
#include "common.cuh"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

template <typename T, typename I>
__global__ void SegmentSumKernel(const T* __restrict__ values, const I* __restrict__ seg,
                                 int64_t n, int64_t d, int64_t s, T* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    int64_t sid = DevLoadId(seg, i);
    if (sid < 0 || sid >= s) continue;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      DevElem<T>::AtomicAdd(out, sid * d + j, DevElem<T>::Load(values, i * d + j));
    }
  }
}

template <typename T, typename I>
void Launch(cudaStream_t stream, const void* values, const void* seg, int64_t n, int64_t d,
            int64_t s, void* out) {
  dim3 block(32, 8);
  int64_t blocks = (n + block.y - 1) / block.y;
  if (blocks > 65535) blocks = 65535;
  if (blocks < 1) blocks = 1;
  SegmentSumKernel<T, I><<<static_cast<unsigned>(blocks), block, 0, stream>>>(
      static_cast<const T*>(values), static_cast<const I*>(seg), n, d, s, static_cast<T*>(out));
}

ffi::Error SegmentSumCudaImpl(cudaStream_t stream, ffi::AnyBuffer values,
                              ffi::AnyBuffer segment_ids, ffi::Result<ffi::AnyBuffer> out) {
  ffi::Error err = CheckSegmentSum(values, segment_ids, *out);
  if (err.failure()) return err;
  const int64_t n = values.dimensions()[0], d = values.dimensions()[1];
  const int64_t s = out->dimensions()[0];
  cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
  err = DispatchFloat<DevBf16>("segment_sum", "values", values.element_type(), [&](auto v) {
    return DispatchId("segment_sum", "segment_ids", segment_ids.element_type(), [&](auto i) {
      Launch<EMBARK_TYPE(v), EMBARK_TYPE(i)>(stream, values.untyped_data(),
                                             segment_ids.untyped_data(), n, d, s,
                                             out->untyped_data());
    });
  });
  if (err.failure()) return err;
  return CudaStatus("segment_sum");
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSegmentSumCuda, embark::SegmentSumCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
