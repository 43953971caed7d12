// segment_sum on CUDA: a warp row-strip per input row adds it into a float32 accumulator with
// atomics; segment ids outside [0, num_segments) are dropped. float32 values accumulate in
// the output itself; bfloat16 values in a float32 workspace (an extra output sized by Python,
// 4 * S * D bytes) that one pass then rounds to bfloat16, as the CPU kernel does (adding in
// bfloat16 would round after every add). No allocation and no host sync, so the handler is
// command-buffer (CUDA graph) compatible.
#include "common.cuh"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

template <typename T, typename I>
__global__ void SegmentSumKernel(const T* __restrict__ values, const I* __restrict__ seg,
                                 int64_t n, int64_t d, int64_t s, float* __restrict__ acc) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    int64_t sid = DevLoadId(seg, i);
    if (sid < 0 || sid >= s) continue;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      atomicAdd(acc + sid * d + j, DevElem<T>::Load(values, i * d + j));
    }
  }
}

ffi::Error SegmentSumCudaImpl(cudaStream_t stream, ffi::AnyBuffer values,
                              ffi::AnyBuffer segment_ids, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace) {
  ffi::Error err = CheckSegmentSum(values, segment_ids, *out);
  if (err.failure()) return err;
  const int64_t n = values.dimensions()[0], d = values.dimensions()[1];
  const int64_t s = out->dimensions()[0];
  const bool direct = values.element_type() == ffi::DataType::F32;
  const size_t need = direct ? 0 : sizeof(float) * static_cast<size_t>(s * d);
  if (workspace->size_bytes() < need) {
    return InvalidArgument("segment_sum: workspace must have at least " + std::to_string(need) +
                           " bytes (a float32 [S, D] accumulator for bfloat16 values), got " +
                           std::to_string(workspace->size_bytes()));
  }
  float* acc = direct ? static_cast<float*>(out->untyped_data())
                      : static_cast<float*>(workspace->untyped_data());
  EMBARK_CUDA_RETURN_IF_ERROR(
      "segment_sum", cudaMemsetAsync(acc, 0, sizeof(float) * static_cast<size_t>(s * d), stream));
  const dim3 block(32, 8);
  const unsigned grid = GridFor(n, block.y);
  err = DispatchFloat<DevBf16>("segment_sum", "values", values.element_type(), [&](auto v) {
    return DispatchId("segment_sum", "segment_ids", segment_ids.element_type(), [&](auto i) {
      using T = EMBARK_TYPE(v);
      using I = EMBARK_TYPE(i);
      SegmentSumKernel<T, I><<<grid, block, 0, stream>>>(
          static_cast<const T*>(values.untyped_data()),
          static_cast<const I*>(segment_ids.untyped_data()), n, d, s, acc);
      if (!direct) {
        ConvertKernel<T><<<GridFor(s * d, 256), 256, 0, stream>>>(
            acc, s * d, static_cast<T*>(out->untyped_data()), nullptr);
      }
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
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),  // workspace
                              {xla::ffi::Traits::kCmdBufferCompatible});
