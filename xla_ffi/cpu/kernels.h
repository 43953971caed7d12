// Handler symbols of the CPU kernels, one per ABI target (embark_abi.h), exported to Python
// by module.cc. A target added to the ABI list without a handler fails to link.
#pragma once

#include "embark_abi.h"
#include "xla/ffi/api/ffi.h"

#define EMBARK_DECLARE_CPU_HANDLER(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(Embark##stem##Cpu);
EMBARK_ABI_TARGETS(EMBARK_DECLARE_CPU_HANDLER)
#undef EMBARK_DECLARE_CPU_HANDLER
