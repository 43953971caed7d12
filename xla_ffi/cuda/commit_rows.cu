// Writes the rows a staged update (sparse_grad_stage) computed into the table and its slots
// on CUDA, in place (outputs alias inputs), when *commit != 0: the kernel reads the flag on
// the device, so the decision never reaches the host. One warp per staged row; rows < 0 or
// >= R are padding. The table may have any rank >= 2 (rows are its leading dimensions).
#include "embark_operands.h"
#include "kernels.h"
#include "optim.cuh"

namespace embark {
namespace {

template <typename T, typename R>
__global__ void CommitRowsKernel(T* table, float* sa, float* sb, const R* rows, const T* values,
                                 const float* va, const float* vb, int64_t vocab, int64_t d,
                                 int64_t c, int64_t wa, int64_t wb, const int32_t* commit) {
  if (*commit == 0) return;
  const int lane = threadIdx.x & 31;
  for (int64_t k = GridWarp(); k < c; k += GridWarps()) {
    const int64_t r = static_cast<int64_t>(rows[k]);
    if (r < 0 || r >= vocab) continue;
    for (int64_t j = lane; j < d; j += 32) table[r * d + j] = values[k * d + j];
    for (int64_t j = lane; j < wa; j += 32) sa[r * wa + j] = va[k * wa + j];
    for (int64_t j = lane; j < wb; j += 32) sb[r * wb + j] = vb[k * wb + j];
  }
}

ffi::Error CommitRowsCudaImpl(cudaStream_t stream, ffi::AnyBuffer table,
                              ffi::Buffer<ffi::F32> slot_a, ffi::Buffer<ffi::F32> slot_b,
                              ffi::AnyBuffer rows, ffi::AnyBuffer values,
                              ffi::Buffer<ffi::F32> staged_a, ffi::Buffer<ffi::F32> staged_b,
                              ffi::Buffer<ffi::S32> commit, ffi::Result<ffi::AnyBuffer> table_out,
                              ffi::Result<ffi::Buffer<ffi::F32>> slot_a_out,
                              ffi::Result<ffi::Buffer<ffi::F32>> slot_b_out, int64_t optimizer) {
  ffi::Error err = CheckCommitRows(table, slot_a, slot_b, rows, values, staged_a, staged_b,
                                   commit, optimizer, *table_out, *slot_a_out, *slot_b_out);
  if (err.failure()) return err;
  err = StartFromInputs("commit_rows", stream,
                        {Same(table_out, table), Same(slot_a_out, slot_a), Same(slot_b_out, slot_b)});
  if (err.failure()) return err;
  const auto dims = table.dimensions();
  const int64_t d = dims[dims.size() - 1];
  const int64_t vocab = d ? static_cast<int64_t>(table.element_count()) / d : 0;
  const int64_t c = static_cast<int64_t>(rows.element_count());
  const int64_t wa = abi::SlotRowWidth(optimizer, 0, d), wb = abi::SlotRowWidth(optimizer, 1, d);
  const bool rows64 = rows.element_type() == ffi::DataType::S64;
  err = DispatchFloat<DevBf16>("commit_rows", "table", table.element_type(), [&](auto tag) {
    using T = EMBARK_TYPE(tag);
    T* tab = static_cast<T*>(table_out->untyped_data());
    const T* val = static_cast<const T*>(values.untyped_data());
    const unsigned grid = GridFor(c, 8);
    if (rows64) {
      CommitRowsKernel<T><<<grid, 256, 0, stream>>>(
          tab, slot_a_out->typed_data(), slot_b_out->typed_data(),
          static_cast<const int64_t*>(rows.untyped_data()), val, staged_a.typed_data(),
          staged_b.typed_data(), vocab, d, c, wa, wb, commit.typed_data());
    } else {
      CommitRowsKernel<T><<<grid, 256, 0, stream>>>(
          tab, slot_a_out->typed_data(), slot_b_out->typed_data(),
          static_cast<const int32_t*>(rows.untyped_data()), val, staged_a.typed_data(),
          staged_b.typed_data(), vocab, d, c, wa, wb, commit.typed_data());
    }
  });
  if (err.failure()) return err;
  return CudaStatus("commit_rows");
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkCommitRowsCuda, embark::CommitRowsCudaImpl,
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  EMBARK_COMMIT_ROWS_OPERANDS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
