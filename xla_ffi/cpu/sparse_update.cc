// Fused, in-place sparse optimizer updates on the CPU: only the given rows of the table and
// of its optimizer slots are read and written (the outputs alias the inputs).
//
//   optimizer 0 SGD:              w -= lr * g
//   optimizer 1 Adagrad:          a += g^2;            w -= lr * g / (sqrt(a) + eps)
//   optimizer 2 row-wise Adagrad: a_r += mean_j(g^2);  w -= lr * g / (sqrt(a_r) + eps)
//   optimizer 3 Adam (lazy):      m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//                                 w -= lr_t * m / (sqrt(v) + eps_t)
//
// hparams = [lr, eps, b1, b2] with Adam's bias corrections folded into lr and eps by the
// caller. Rows < 0 or >= V are padding and skipped. Rows must be unique (the Python op
// merges duplicates first unless told they are unique): workers own disjoint row ranges.
#include "cpu_optim.h"
#include "embark_ffi.h"
#include "kernels.h"

namespace embark {
namespace {

template <typename T>
void Update(ffi::ThreadPool& pool, T* table, float* sa, float* sb, const ffi::AnyBuffer& rows,
            const float* grads, int64_t vocab, int64_t d, int64_t c, int64_t opt,
            const float* hp) {
  ParallelFor(pool, c, 64, [=, &rows](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      if (k + 4 < k1) {
        int64_t nx = LoadId(rows, k + 4);
        if (nx >= 0 && nx < vocab) Prefetch(table + nx * d);
      }
      int64_t r = LoadId(rows, k);
      if (r < 0 || r >= vocab) continue;
      ApplyRow(opt, table, sa, sb, r, grads + k * d, d, hp);
    }
  });
}

ffi::Error SparseUpdateImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::Buffer<ffi::F32> slot_a,
                            ffi::Buffer<ffi::F32> slot_b, ffi::AnyBuffer rows,
                            ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::F32> hparams,
                            ffi::Result<ffi::AnyBuffer> table_out,
                            ffi::Result<ffi::Buffer<ffi::F32>> slot_a_out,
                            ffi::Result<ffi::Buffer<ffi::F32>> slot_b_out, int64_t optimizer) {
  auto td = table.dimensions();
  auto gd = grads.dimensions();
  if (td.size() != 2 || gd.size() != 2 || gd[1] != td[1]) {
    return InvalidArgument("sparse_update expects table [V, D] and grads [C, D]");
  }
  const int64_t vocab = td[0], d = td[1], c = gd[0];
  if (static_cast<int64_t>(rows.element_count()) != c || !IsIdType(rows.element_type())) {
    return InvalidArgument("sparse_update: rows must be int32/int64 [C] matching grads [C, D]");
  }
  if (hparams.element_count() < 4) return InvalidArgument("sparse_update: hparams must be [4]");
  const int64_t need_a = SlotAElements(optimizer, vocab, d);
  const int64_t need_b = SlotBElements(optimizer, vocab, d);
  if (!ValidOptimizer(optimizer)) return InvalidArgument("sparse_update: bad optimizer");
  if (static_cast<int64_t>(slot_a.element_count()) < need_a ||
      static_cast<int64_t>(slot_b.element_count()) < need_b) {
    return InvalidArgument("sparse_update: optimizer slots too small for the table");
  }
  // The outputs alias the inputs (input_output_aliases); copy only if XLA did not alias.
  CopyIfNotAliased(table_out->untyped_data(), table.untyped_data(), table.size_bytes());
  CopyIfNotAliased(slot_a_out->typed_data(), slot_a.typed_data(), slot_a.size_bytes());
  CopyIfNotAliased(slot_b_out->typed_data(), slot_b.typed_data(), slot_b.size_bytes());
  const float* hp = hparams.typed_data();
  if (table.element_type() == ffi::DataType::F32) {
    Update(pool, static_cast<float*>(table_out->untyped_data()), slot_a_out->typed_data(),
           slot_b_out->typed_data(), rows, grads.typed_data(), vocab, d, c, optimizer, hp);
  } else if (table.element_type() == ffi::DataType::BF16) {
    Update(pool, static_cast<uint16_t*>(table_out->untyped_data()), slot_a_out->typed_data(),
           slot_b_out->typed_data(), rows, grads.typed_data(), vocab, d, c, optimizer, hp);
  } else {
    return InvalidArgument("sparse_update: table must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkSparseUpdateCpu, embark::SparseUpdateImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()              // table [V, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // slot a
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // slot b
                                  .Arg<xla::ffi::AnyBuffer>()              // rows [C]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // grads [C, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // hparams [4]
                                  .Ret<xla::ffi::AnyBuffer>()              // table (aliased)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // slot a (aliased)
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // slot b (aliased)
                                  .Attr<int64_t>("optimizer"));
