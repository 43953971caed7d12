// Dedup on the CPU: sorted unique non-negative ids in a fixed capacity, the inverse index and
// counts; num_unique is the true distinct count, so the caller sees any overflow.
#include "cpu_sort.h"
#include "embark_dispatch.h"
#include "embark_ffi.h"
#include "embark_operands.h"
#include "kernels.h"

namespace embark {
namespace {

ffi::Error UniqueImpl(ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> unique,
                      ffi::Result<ffi::Buffer<ffi::S32>> inverse,
                      ffi::Result<ffi::Buffer<ffi::S32>> counts,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_unique,
                      ffi::Result<ffi::AnyBuffer> /*workspace: CUDA only*/) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int64_t cap = static_cast<int64_t>(unique->element_count());
  ffi::Error err = CheckUnique(ids, *unique, *inverse, *counts, *num_unique);
  if (err.failure()) return err;
  SortedIds s = SortValidIds(n, [&ids](int64_t i) { return LoadId(ids, i); });
  RawArray<int64_t> starts = RunStarts(s.keys);
  const int64_t u = static_cast<int64_t>(starts.size()) - 1;
  int32_t* inv = inverse->typed_data();
  int32_t* cnt = counts->typed_data();
  for (int64_t i = 0; i < n; ++i) inv[i] = -1;
  for (int64_t k = 0; k < cap; ++k) cnt[k] = 0;
  err = DispatchId("unique", "ids", ids.element_type(), [&](auto tag) {
    using I = EMBARK_TYPE(tag);
    I* out = static_cast<I*>(unique->untyped_data());
    for (int64_t k = 0; k < cap; ++k) {
      out[k] = static_cast<I>(k < u ? static_cast<int64_t>(s.keys[starts[k]]) : -1);
    }
  });
  if (err.failure()) return err;
  for (int64_t k = 0; k < u && k < cap; ++k) {
    cnt[k] = static_cast<int32_t>(starts[k + 1] - starts[k]);
    for (int64_t j = starts[k]; j < starts[k + 1]; ++j) inv[s.positions[j]] = static_cast<int32_t>(k);
  }
  num_unique->typed_data()[0] = static_cast<int32_t>(u);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embark

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbarkUniqueCpu, embark::UniqueImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()             // ids [N]
                                  .Ret<xla::ffi::AnyBuffer>()             // unique_ids [C]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // inverse [N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [C]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // num_unique []
                                  .Ret<xla::ffi::AnyBuffer>());            // workspace
