// The _ffi_cpu Python module: `registrations()` maps each FFI target name to a capsule holding
// its handler, which embark_jax._native registers with jax.ffi.register_ffi_target.
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
    d["embark_segment_sum"] = Capsule(EmbarkSegmentSumCpu);
    d["embark_lookup_pool"] = Capsule(EmbarkLookupPoolCpu);
    d["embark_unique"] = Capsule(EmbarkUniqueCpu);
    d["embark_sparse_grad"] = Capsule(EmbarkSparseGradCpu);
    d["embark_sparse_update"] = Capsule(EmbarkSparseUpdateCpu);
    d["embark_sparse_grad_update"] = Capsule(EmbarkSparseGradUpdateCpu);
    return d;
  });
}
