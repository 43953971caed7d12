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
// Bytes of the dedup workspace for n ids of key_bytes (4 or 8), with the long-run split for
// gradient rows of width d when d > 0 (sparse_grad, sparse_grad_update); see dedup.cuh.
size_t DedupWorkspaceBytes(int64_t n, int key_bytes, int64_t d);
// Bytes of the lookup_pool workspace for num_out bags of width d; see lookup_pool.cu.
size_t LookupPoolWorkspaceBytes(int64_t num_out, int64_t d, int64_t combiner);
// Bytes of the hash_find_or_insert workspace for n ids (a CUB sort by bucket); hash_table.cu.
size_t HashTableWorkspaceBytes(int64_t n);
}  // namespace embark
