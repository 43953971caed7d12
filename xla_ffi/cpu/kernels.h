// Handler symbols of the CPU kernels, exported to Python by module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkSegmentSumCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkLookupPoolCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkUniqueCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkSparseGradCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkSparseUpdateCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkSparseGradUpdateCpu);
