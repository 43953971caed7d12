// The _ffi_cpu Python module: `registrations()` maps each FFI target name to a capsule holding
// its handler, which embark_jax.ops.native registers with jax.ffi.register_ffi_target. The
// map is generated from the ABI's target list (embark_abi.h), so it registers exactly the
// targets Python calls.
#include <pybind11/pybind11.h>

#include "kernels.h"

namespace py = pybind11;

namespace {

template <typename T>
py::capsule Capsule(T* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

PYBIND11_MODULE(_ffi_cpu, m) {
  m.doc() = "embark_jax CPU kernels (XLA FFI handlers)";
  m.def("registrations", []() {
    py::dict d;
#define EMBARK_REGISTER_CPU(name, stem) \
  d[EMBARK_ABI_TARGET_NAME(name)] = Capsule(Embark##stem##Cpu);
    EMBARK_ABI_TARGETS(EMBARK_REGISTER_CPU)
#undef EMBARK_REGISTER_CPU
    return d;
  });
}
