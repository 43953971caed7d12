// The _ffi_cuda Python module: same target names as _ffi_cpu, CUDA handlers, plus the sizes
// of the workspaces that Python passes as extra outputs.
#include <pybind11/pybind11.h>

#include "kernels.h"

namespace py = pybind11;

namespace {
template <typename T>
py::capsule Capsule(T* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

PYBIND11_MODULE(_ffi_cuda, m) {
  m.doc() = "embark_jax CUDA kernels (XLA FFI handlers)";
  m.def("registrations", []() {
    py::dict d;
    d["embark_segment_sum"] = Capsule(EmbarkSegmentSumCuda);
    d["embark_lookup_pool"] = Capsule(EmbarkLookupPoolCuda);
    d["embark_unique"] = Capsule(EmbarkUniqueCuda);
    d["embark_sparse_grad"] = Capsule(EmbarkSparseGradCuda);
    d["embark_sparse_grad_update"] = Capsule(EmbarkSparseGradUpdateCuda);
    d["embark_sparse_update"] = Capsule(EmbarkSparseUpdateCuda);
    return d;
  });
  m.def("dedup_workspace_bytes", &embark::DedupWorkspaceBytes, py::arg("n"), py::arg("key_bytes"),
        "Workspace bytes the dedup-based kernels need for n ids (queries CUB; needs a GPU).");
}
