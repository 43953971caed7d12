// The _ffi_cuda Python module: same target names as _ffi_cpu, CUDA handlers.
#include <pybind11/pybind11.h>

#include "kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(_ffi_cuda, m) {
  m.doc() = "embark_jax CUDA kernels (XLA FFI handlers)";
  m.def("registrations", []() {
    py::dict d;
    d["embark_segment_sum"] = py::capsule(reinterpret_cast<void*>(EmbarkSegmentSumCuda));
    return d;
  });
}
