// The _ffi_cpu Python module: `registrations()` maps each FFI target name to a capsule holding
// its handler, which embark_jax.ops.native registers with jax.ffi.register_ffi_target. The
// map is generated from the ABI's target list (embark_abi.h), so it registers exactly the
// targets Python calls.
#include <pybind11/pybind11.h>

#include <string>

#include "cpu_hugepages.h"
#include "cpu_isa.h"
#include "cpu_malloc.h"
#include "embark_ffi.h"
#include "kernels.h"

namespace py = pybind11;

namespace {

template <typename T>
py::capsule Capsule(T* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

constexpr embark::CpuIsa kIsas[] = {embark::CpuIsa::SCALAR, embark::CpuIsa::AVX2,
                                    embark::CpuIsa::AVX512, embark::CpuIsa::AVX512_BF16};

// The instruction set named `name` ("scalar", "avx2", "avx512", "avx512bf16"); ValueError
// otherwise.
embark::CpuIsa ParseIsa(const std::string& name) {
  for (embark::CpuIsa isa : kIsas) {
    if (name == embark::CpuIsaName(isa)) return isa;
  }
  throw py::value_error("cpu isa must be one of scalar, avx2, avx512, avx512bf16; got '" + name +
                        "'");
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
  m.def("cpu_isa", []() { return std::string(embark::CpuIsaName(embark::ActiveCpuIsa())); },
        "The SIMD instruction set the CPU kernels use now.");
  m.def("best_cpu_isa", []() { return std::string(embark::CpuIsaName(embark::BestCpuIsa())); },
        "The best SIMD instruction set this CPU and OS support.");
  m.def(
      "set_cpu_isa",
      [](const std::string& name) {
        const embark::CpuIsa isa = ParseIsa(name);
        if (!embark::SetCpuIsa(isa)) {
          throw py::value_error("cpu isa '" + name + "' is not supported by this CPU (best: " +
                                embark::CpuIsaName(embark::BestCpuIsa()) + ")");
        }
      },
      "Uses the named instruction set (at most the best supported) from the next call on.");
  m.def("set_cpu_spin", &embark::SetCpuSpin,
        "Whether the workers stay awake (spin, then yield) a few ms after each job.");
  m.def("cpu_spin", &embark::GetCpuSpin);
  m.def("cpu_threads", []() { return embark::CpuPoolThreads(); },
        "Threads a CPU kernel runs on (its caller included); starts the worker pool.");
  m.def(
      "advise_huge_pages",
      [](uintptr_t address, int64_t bytes) {
        py::gil_scoped_release release;
        return embark::AdviseHugePages(reinterpret_cast<const void*>(address), bytes);
      },
      "Moves the 2 MiB-aligned interior of a host buffer into huge pages now; bytes or -errno.");
  m.def("tune_malloc", []() { return embark::TuneHostMalloc(); },
        "Sets glibc's mmap and trim thresholds (cpu_malloc.h): 1 done, 0 not glibc, -1 refused.");
  m.def("huge_page_mode",
        []() { return embark::GetHugePageMode() == embark::HugePageMode::AUTO ? "auto" : "off"; });
  m.def("set_huge_page_mode", [](bool on) {
    embark::SetHugePageMode(on ? embark::HugePageMode::AUTO : embark::HugePageMode::OFF);
  });
  m.def("huge_page_stats", []() {
    const embark::HugePageStats s = embark::GetHugePageStats();
    py::dict d;
    d["queued"] = s.queued;
    d["advised"] = s.advised;
    d["failed"] = s.failed;
    d["bytes"] = s.bytes;
    d["last_error"] = s.last_error;
    return d;
  });
  m.def(
      "wait_huge_pages",
      [](double timeout_s) {
        py::gil_scoped_release release;
        return embark::WaitHugePages(timeout_s);
      },
      "Waits until the background thread has advised every queued table.");
}
