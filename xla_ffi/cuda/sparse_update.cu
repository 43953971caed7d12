// Fused in-place sparse optimizer update on CUDA: one warp per (unique) row, outputs alias
// the inputs. Rows < 0 or >= V are padding.
#include "embark_operands.h"
#include "kernels.h"
#include "optim.cuh"

namespace embark {
namespace {

template <typename T>
__global__ void SparseUpdateKernel(T* table, float* sa, float* sb, const void* rows, bool rows64,
                                   const float* grads, int64_t vocab, int64_t d, int64_t c,
                                   Optimizer opt, const float* hp) {
  const int lane = threadIdx.x & 31;
  const Hparams h = LoadHparams(hp);
  for (int64_t k = GridWarp(); k < c; k += GridWarps()) {
    const int64_t r = DevLoadIdAny(rows, rows64, k);
    if (r < 0 || r >= vocab) continue;
    const float* g = grads + k * d;
    float step = 0.0f;
    if (opt == Optimizer::ROW_WISE_ADAGRAD) {
      float sq = 0.0f;
      for (int64_t j = lane; j < d; j += 32) sq += g[j] * g[j];
      step = RowWiseStep(sa, r, sq, d, h);
    }
    for (int64_t j = lane; j < d; j += 32) ApplyElem(opt, table, sa, sb, r, j, d, g[j], h, step);
  }
}

ffi::Error SparseUpdateCudaImpl(cudaStream_t stream, ffi::AnyBuffer table,
                                ffi::Buffer<ffi::F32> slot_a, ffi::Buffer<ffi::F32> slot_b,
                                ffi::AnyBuffer rows, ffi::Buffer<ffi::F32> grads,
                                ffi::Buffer<ffi::F32> hparams,
                                ffi::Result<ffi::AnyBuffer> table_out,
                                ffi::Result<ffi::Buffer<ffi::F32>> slot_a_out,
                                ffi::Result<ffi::Buffer<ffi::F32>> slot_b_out, int64_t optimizer) {
  ffi::Error err = CheckSparseUpdate(table, slot_a, slot_b, rows, grads, hparams, optimizer,
                                     *table_out, *slot_a_out, *slot_b_out);
  if (err.failure()) return err;
  err = StartFromInputs("sparse_update", stream,
                        {Same(table_out, table), Same(slot_a_out, slot_a), Same(slot_b_out, slot_b)});
  if (err.failure()) return err;
  const bool rows64 = rows.element_type() == ffi::DataType::S64;
  const int64_t vocab = table.dimensions()[0], d = table.dimensions()[1];
  const int64_t c = grads.dimensions()[0];
  err = DispatchFloat<DevBf16>("sparse_update", "table", table.element_type(), [&](auto tag) {
    using T = EMBARK_TYPE(tag);
    SparseUpdateKernel<T><<<GridFor(c, 8), 256, 0, stream>>>(
        static_cast<T*>(table_out->untyped_data()), slot_a_out->typed_data(),
        slot_b_out->typed_data(), rows.untyped_data(), rows64, grads.typed_data(), vocab, d, c,
        static_cast<Optimizer>(optimizer), hparams.typed_data());
  });
  if (err.failure()) return err;
  return CudaStatus("sparse_update");
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSparseUpdateCuda, embark::SparseUpdateCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("optimizer"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
