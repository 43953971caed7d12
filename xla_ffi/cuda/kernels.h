// Handler symbols of the CUDA kernels, one per ABI target (embark_abi.h), exported to Python
// by cuda/module.cc. A target added to the ABI list without a handler fails to link.
#pragma once

#include <cstddef>
#include <cstdint>

#include "embark_abi.h"
#include "xla/ffi/api/ffi.h"

#define EMBARK_DECLARE_CUDA_HANDLER(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(Embark##stem##Cuda);
EMBARK_ABI_TARGETS(EMBARK_DECLARE_CUDA_HANDLER)
#undef EMBARK_DECLARE_CUDA_HANDLER

namespace embark {
// Bytes of the dedup workspace for n ids of key_bytes (4 or 8); see dedup.cuh.
size_t DedupWorkspaceBytes(int64_t n, int key_bytes);
}  // namespace embark
