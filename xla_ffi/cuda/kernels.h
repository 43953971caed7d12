// Handler symbols of the CUDA kernels, exported to Python by cuda/module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EmbarkSegmentSumCuda);
