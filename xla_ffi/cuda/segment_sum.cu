// segment_sum on CUDA: one thread block row-strip per input row, atomics into the output.
// Segment ids outside [0, num_segments) are dropped. Output is zeroed on the stream first;
// no allocation and no host sync, so the handler is command-buffer (CUDA graph) compatible.
#include "common.cuh"
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
  auto vdims = values.dimensions();
  auto odims = out->dimensions();
  if (vdims.size() != 2 || odims.size() != 2 || odims[1] != vdims[1] ||
      static_cast<int64_t>(segment_ids.element_count()) != vdims[0]) {
    return InvalidArgument("segment_sum expects values [N, D], segment_ids [N], output [S, D]");
  }
  int64_t n = vdims[0], d = vdims[1], s = odims[0];
  cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
  bool ids64 = segment_ids.element_type() == ffi::DataType::S64;
  if (!IsIdType(segment_ids.element_type())) return InvalidArgument("segment_sum: int ids only");
  switch (values.element_type()) {
    case ffi::DataType::F32:
      if (ids64)
        Launch<float, int64_t>(stream, values.untyped_data(), segment_ids.untyped_data(), n, d, s,
                               out->untyped_data());
      else
        Launch<float, int32_t>(stream, values.untyped_data(), segment_ids.untyped_data(), n, d, s,
                               out->untyped_data());
      break;
    case ffi::DataType::BF16:
      if (ids64)
        Launch<__nv_bfloat16, int64_t>(stream, values.untyped_data(), segment_ids.untyped_data(),
                                       n, d, s, out->untyped_data());
      else
        Launch<__nv_bfloat16, int32_t>(stream, values.untyped_data(), segment_ids.untyped_data(),
                                       n, d, s, out->untyped_data());
      break;
    default:
      return InvalidArgument("segment_sum: values must be float32 or bfloat16");
  }
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
