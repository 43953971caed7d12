// Dedup on the CPU: sorted unique non-negative ids in a fixed capacity, the inverse index and
// counts; num_unique is the true distinct count, so the caller sees any overflow.
#include "cpu_sort.h"
#include "embark_ffi.h"
#include "kernels.h"

namespace embark {
namespace {

ffi::Error UniqueImpl(ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> unique,
                      ffi::Result<ffi::Buffer<ffi::S32>> inverse,
                      ffi::Result<ffi::Buffer<ffi::S32>> counts,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_unique,
                      ffi::Result<ffi::AnyBuffer> /*workspace: CUDA only*/) {
  if (!IsIdType(ids.element_type()) || unique->element_type() != ids.element_type()) {
    return InvalidArgument("unique: ids must be int32 or int64 and unique_ids of the same type");
  }
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int64_t cap = static_cast<int64_t>(unique->element_count());
  SortedIds s = SortValidIds(n, [&ids](int64_t i) { return LoadId(ids, i); });
  std::vector<int64_t> starts = RunStarts(s.keys);
  const int64_t u = static_cast<int64_t>(starts.size()) - 1;
  int32_t* inv = inverse->typed_data();
  int32_t* cnt = counts->typed_data();
  for (int64_t i = 0; i < n; ++i) inv[i] = -1;
  for (int64_t k = 0; k < cap; ++k) cnt[k] = 0;
  bool ids64 = ids.element_type() == ffi::DataType::S64;
  for (int64_t k = 0; k < cap; ++k) {
    int64_t v = k < u ? static_cast<int64_t>(s.keys[starts[k]]) : -1;
    if (ids64) static_cast<int64_t*>(unique->untyped_data())[k] = v;
    else static_cast<int32_t*>(unique->untyped_data())[k] = static_cast<int32_t>(v);
  }
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
