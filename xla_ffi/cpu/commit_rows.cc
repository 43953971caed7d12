// Writes the rows a staged update (sparse_grad_stage) computed into the table and its slots,
// in place (the outputs alias the inputs), when commit != 0; when it is 0 nothing is written
// and the table and slots stay bit-identical. The table may have any rank >= 2: its rows are
// all its leading dimensions, so a shard_map block [1, R, D] is updated as it is. Rows < 0 or
// >= R are padding. Rows are distinct (they come from a dedup), so workers never collide.
#include <cstring>

#include "cpu_optim.h"
#include "embark_dispatch.h"
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

ffi::Error CommitRowsCpu(ffi::ThreadPool pool, const CommitRowsOperands& o) {
  StartTableAndSlots(o.table, o.slot_a, o.slot_b, o.table_out, o.slot_a_out, o.slot_b_out);
  if (o.commit.typed_data()[0] == 0) return ffi::Error::Success();
  const TableRows t = RowsOf(o.table);
  const int64_t row_bytes = t.d * static_cast<int64_t>(ffi::ByteWidth(o.table.element_type()));
  const int64_t wa = abi::SlotRowWidth(o.optimizer, 0, t.d);
  const int64_t wb = abi::SlotRowWidth(o.optimizer, 1, t.d);
  return DispatchId("commit_rows", "rows", o.rows.element_type(), [&](auto id) {
    Commit(pool, static_cast<char*>(o.table_out.untyped_data()), o.slot_a_out.typed_data(),
           o.slot_b_out.typed_data(), static_cast<const EMBARK_TYPE(id)*>(o.rows.untyped_data()),
           static_cast<const char*>(o.values.untyped_data()), o.staged_a.typed_data(),
           o.staged_b.typed_data(), t.vocab, static_cast<int64_t>(o.rows.element_count()),
           row_bytes, wa, wb);
  });
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkCommitRowsCpu,
                              embark::CheckedHandler(embark::CheckCommitRows,
                                                     embark::CommitRowsCpu),
                              xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()
                                  EMBARK_COMMIT_ROWS_OPERANDS);
