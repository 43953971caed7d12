// Handler symbols of the CUDA kernels, exported to Python by cuda/module.cc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkSegmentSumCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkLookupPoolCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkUniqueCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkSparseGradCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkSparseGradUpdateCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkSparseUpdateCuda);

namespace embark {
// Bytes of the dedup workspace for n ids of key_bytes (4 or 8); see dedup.cuh.
size_t DedupWorkspaceBytes(int64_t n, int key_bytes);
}  // namespace embark
