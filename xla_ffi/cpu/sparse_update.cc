// Fused, in-place sparse optimizer updates on the CPU: only the given rows of the table and
// of its optimizer slots are read and written (the outputs alias the inputs).
//
//   optimizer 0 SGD:              w -= lr * g
//   optimizer 1 Adagrad:          a += g^2;            w -= lr * g / (sqrt(a) + eps)
//   optimizer 2 row-wise Adagrad: a_r += mean_j(g^2);  w -= lr * g / (sqrt(a_r) + eps)
//   optimizer 3 Adam (lazy):      m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//                                 w -= lr_t * m / (sqrt(v) + eps_t)
//
// The optimizer ids and the hparams layout ([lr, eps, b1, b2, rounding, seed_lo, seed_hi],
// Adam's bias corrections folded into lr and eps by the caller) are the ABI's (embark_abi.h).
// A bfloat16 table is rounded to nearest even, or stochastically with rounding = 1 (bits
// hashed from the seed, row and column: the result does not depend on the threads). Rows < 0
// or >= V are padding and skipped. Rows must be unique (the Python op merges duplicates first
// unless told they are unique): workers own disjoint row ranges.
#include "cpu_optim.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

template <typename T>
void Update(ffi::ThreadPool& pool, T* table, float* sa, float* sb, const ffi::AnyBuffer& rows,
            const float* grads, int64_t vocab, int64_t d, int64_t c, Optimizer opt,
            const abi::Hparams& hp) {
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
  ffi::Error err = CheckSparseUpdate(table, slot_a, slot_b, rows, grads, hparams, optimizer,
                                     *table_out, *slot_a_out, *slot_b_out);
  if (err.failure()) return err;
  const int64_t vocab = table.dimensions()[0], d = table.dimensions()[1];
  const int64_t n = grads.dimensions()[0];
  StartTableAndSlots(table, slot_a, slot_b, *table_out, *slot_a_out, *slot_b_out);
  const abi::Hparams hp = abi::LoadHparams(hparams.typed_data());
  return DispatchFloat<HostBf16>("sparse_update", "table", table.element_type(), [&](auto tag) {
    Update(pool, static_cast<EMBARK_TYPE(tag)*>(table_out->untyped_data()),
           slot_a_out->typed_data(), slot_b_out->typed_data(), rows, grads.typed_data(), vocab, d,
           n, static_cast<Optimizer>(optimizer), hp);
  });
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
