// Writes the rows a staged update (sparse_grad_stage) computed into the table and its slots,
// in place (the outputs alias the inputs), when commit != 0; when it is 0 nothing is written
// and the table and slots stay bit-identical. The table may have any rank >= 2: its rows are
// all its leading dimensions, so a shard_map block [1, R, D] is updated as it is. Rows < 0 or
// >= R are padding. Rows are distinct (they come from a dedup), so workers never collide.
#include <cstring>

#include "cpu_optim.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

// Copies `width` elements of staged row k into row r of `dst` (a table or a slot).
template <typename E>
inline void CopyRow(E* dst, const E* src, int64_t r, int64_t k, int64_t width) {
  std::memcpy(dst + r * width, src + k * width, static_cast<size_t>(width) * sizeof(E));
}

template <typename R>
void Commit(ffi::ThreadPool& pool, char* table, float* sa, float* sb, const R* rows,
            const char* values, const float* va, const float* vb, int64_t vocab, int64_t c,
            int64_t row_bytes, int64_t wa, int64_t wb) {
  ParallelFor(pool, c, 256, [=](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t r = static_cast<int64_t>(rows[k]);
      if (r < 0 || r >= vocab) continue;
      CopyRow(table, values, r, k, row_bytes);
      if (wa) CopyRow(sa, va, r, k, wa);
      if (wb) CopyRow(sb, vb, r, k, wb);
    }
  });
}

ffi::Error CommitRowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::Buffer<ffi::F32> slot_a,
                          ffi::Buffer<ffi::F32> slot_b, ffi::AnyBuffer rows, ffi::AnyBuffer values,
                          ffi::Buffer<ffi::F32> staged_a, ffi::Buffer<ffi::F32> staged_b,
                          ffi::Buffer<ffi::S32> commit, ffi::Result<ffi::AnyBuffer> table_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> slot_a_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> slot_b_out, int64_t optimizer) {
  ffi::Error err = CheckCommitRows(table, slot_a, slot_b, rows, values, staged_a, staged_b,
                                   commit, optimizer, *table_out, *slot_a_out, *slot_b_out);
  if (err.failure()) return err;
  StartTableAndSlots(table, slot_a, slot_b, *table_out, *slot_a_out, *slot_b_out);
  if (commit.typed_data()[0] == 0) return ffi::Error::Success();
  const auto dims = table.dimensions();
  const int64_t d = dims[dims.size() - 1];
  const int64_t vocab = d ? static_cast<int64_t>(table.element_count()) / d : 0;
  const int64_t c = static_cast<int64_t>(rows.element_count());
  const int64_t row_bytes = d * static_cast<int64_t>(ffi::ByteWidth(table.element_type()));
  const int64_t wa = abi::SlotRowWidth(optimizer, 0, d), wb = abi::SlotRowWidth(optimizer, 1, d);
  char* tab = static_cast<char*>(table_out->untyped_data());
  const char* val = static_cast<const char*>(values.untyped_data());
  float* sa = slot_a_out->typed_data();
  float* sb = slot_b_out->typed_data();
  if (rows.element_type() == ffi::DataType::S64) {
    Commit(pool, tab, sa, sb, static_cast<const int64_t*>(rows.untyped_data()), val,
           staged_a.typed_data(), staged_b.typed_data(), vocab, c, row_bytes, wa, wb);
  } else {
    Commit(pool, tab, sa, sb, static_cast<const int32_t*>(rows.untyped_data()), val,
           staged_a.typed_data(), staged_b.typed_data(), vocab, c, row_bytes, wa, wb);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkCommitRowsCpu, embark::CommitRowsImpl,
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()
                                  EMBARK_COMMIT_ROWS_OPERANDS);
