// The _ffi_cuda Python module: the same targets as _ffi_cpu (both generated from the ABI's
// target list, embark_abi.h) with CUDA handlers, plus the sizes of the workspaces that Python
// passes as extra outputs.
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
#define EMBARK_REGISTER_CUDA(name, stem) \
  d[EMBARK_ABI_TARGET_NAME(name)] = Capsule(Embark##stem##Cuda);
    EMBARK_ABI_TARGETS(EMBARK_REGISTER_CUDA)
#undef EMBARK_REGISTER_CUDA
    return d;
  });
  m.def("dedup_workspace_bytes", &embark::DedupWorkspaceBytes, py::arg("n"), py::arg("key_bytes"),
        py::arg("d") = 0,
        "Workspace bytes the dedup-based kernels need for n ids, with the split of long runs "
        "for gradient rows of width d > 0 (queries CUB; needs a GPU).");
  m.def("lookup_pool_workspace_bytes", &embark::LookupPoolWorkspaceBytes, py::arg("num_out"),
        py::arg("d"), py::arg("combiner"),
        "Workspace bytes lookup_pool needs for num_out output rows of width d.");
  m.def("hash_table_workspace_bytes", &embark::HashTableWorkspaceBytes, py::arg("n"),
        "Workspace bytes hash_find_or_insert needs for n ids (queries CUB; needs a GPU).");
}
