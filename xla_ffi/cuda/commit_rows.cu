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

ffi::Error CommitRowsCuda(cudaStream_t stream, const CommitRowsOperands& o) {
  ffi::Error err = StartFromInputs(
      "commit_rows", stream,
      {Same(o.table_out, o.table), Same(o.slot_a_out, o.slot_a), Same(o.slot_b_out, o.slot_b)});
  if (err.failure()) return err;
  const TableRows t = RowsOf(o.table);
  const int64_t c = static_cast<int64_t>(o.rows.element_count());
  const int64_t wa = abi::SlotRowWidth(o.optimizer, 0, t.d);
  const int64_t wb = abi::SlotRowWidth(o.optimizer, 1, t.d);
  err = DispatchFloat<DevBf16>("commit_rows", "table", o.table.element_type(), [&](auto tag) {
    using T = EMBARK_TYPE(tag);
    return DispatchId("commit_rows", "rows", o.rows.element_type(), [&](auto id) {
      CommitRowsKernel<T><<<GridFor(c, 8), 256, 0, stream>>>(
          static_cast<T*>(o.table_out.untyped_data()), o.slot_a_out.typed_data(),
          o.slot_b_out.typed_data(), static_cast<const EMBARK_TYPE(id)*>(o.rows.untyped_data()),
          static_cast<const T*>(o.values.untyped_data()), o.staged_a.typed_data(),
          o.staged_b.typed_data(), t.vocab, t.d, c, wa, wb, o.commit.typed_data());
    });
  });
  if (err.failure()) return err;
  return CudaStatus("commit_rows");
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkCommitRowsCuda,
                              embark::CheckedHandler(embark::CheckCommitRows,
                                                     embark::CommitRowsCuda),
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  EMBARK_COMMIT_ROWS_OPERANDS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
