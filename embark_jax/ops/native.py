"""Loads the compiled kernels and registers them as XLA FFI targets, on first use.

`_ffi_cpu` is always built; its targets are registered for `platform="cpu"`. `_ffi_cuda` is
built when nvcc was found; its targets (same names) are registered for `platform="CUDA"` when
a JAX CUDA plugin is installed.

Nothing happens at import: the first kernel wrapper traced (`_ffi._call`), `build_info()` or
`registered_targets()` calls `ensure_registered()`, which loads the extensions and registers
their targets once. So `import embark_jax.ops` neither loads the native build nor fails
without one, and code that only plans or uses the reference ops never pays for it.
Registration never initialises a JAX backend (XLA queues targets registered before the
backend exists), so `jax.config.update("jax_num_cpu_devices", 8)` still works after it.

Code that runs an exported or deserialised computation without tracing embark_jax's ops must
call `ensure_registered()` itself first.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import threading

import jax
import jaxlib

from embark_jax.core.cpu_env import (
    CPU_ISAS,
    check_cpu_env,
    huge_page_mode_from_env,
    malloc_mode_from_env,
    parse_huge_page_mode,
    spin_mode_from_env,
    user_sets_malloc,
)

__all__ = [
    "NativeBuildError",
    "build_info",
    "cpu_isa",
    "cpu_threads",
    "ensure_registered",
    "huge_page_mode",
    "huge_page_stats",
    "huge_pages",
    "malloc_mode",
    "registered_targets",
    "set_cpu_isa",
    "set_huge_page_mode",
    "wait_huge_pages",
]


# platform -> target names registered there; a platform appears once all its targets are in.
_REGISTERED: dict[str, set[str]] = {}
_REGISTER_LOCK = threading.Lock()
_registered_all = False
_MALLOC_MODE = "off"  # set once by ensure_registered (_apply_malloc_mode)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


class NativeBuildError(ImportError):
    """The native kernels are missing or were built against an incompatible jaxlib."""


def _load_build_info():
    try:
        return importlib.import_module("embark_jax._build_info")
    except ImportError as e:
        raise NativeBuildError(
            "embark_jax's native kernels are not built: install the package with "
            "`pip install --no-build-isolation .` (see BUILD.md)"
        ) from e


def _check_ffi_version(built_with: str) -> None:
    # An FFI handler compiled against newer headers than the running jaxlib is refused by
    # XLA at call time ("API version ... incompatible"); fail early with the fix instead.
    if _version_tuple(built_with) > _version_tuple(jaxlib.__version__):
        raise NativeBuildError(
            f"embark_jax's kernels were built against jaxlib {built_with}'s FFI headers but "
            f"jaxlib {jaxlib.__version__} is running. Rebuild against the installed jaxlib: "
            "`pip install --no-build-isolation --force-reinstall --no-deps .` (BUILD.md)"
        )


def _cuda_plugin_installed() -> bool:
    return any(
        importlib.util.find_spec(name) is not None
        for name in (
            "jax_cuda13_plugin",
            "jax_cuda12_plugin",
            "jax_plugins.xla_cuda13",
            "jax_plugins.xla_cuda12",
        )
        if _parent_importable(name)
    )


def _parent_importable(name: str) -> bool:
    parent = name.rpartition(".")[0]
    return not parent or importlib.util.find_spec(parent) is not None


def _register(module_name: str, platform: str) -> None:
    if platform in _REGISTERED:  # a retry after a later platform failed
        return
    module = importlib.import_module(module_name)
    names = set()
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
        names.add(name)
    _REGISTERED[platform] = names


def ensure_registered() -> None:
    """Loads the native kernels and registers their FFI targets, once per process.

    Idempotent and thread-safe; after the first call it costs one flag check. Raises
    `NativeBuildError` when the native build is missing or built against a newer jaxlib.
    """
    global _registered_all
    if _registered_all:
        return
    with _REGISTER_LOCK:
        if _registered_all:
            return
        info = _load_build_info()
        _check_ffi_version(info.JAXLIB_VERSION)
        check_cpu_env()
        _register("embark_jax._ffi_cpu", "cpu")
        if (isa := os.environ.get("EMBARK_CPU_ISA", "").strip().lower()) not in ("", "auto"):
            importlib.import_module("embark_jax._ffi_cpu").set_cpu_isa(isa)  # lock held
        cpu = importlib.import_module("embark_jax._ffi_cpu")
        cpu.set_huge_page_mode(huge_page_mode_from_env() == "auto")
        cpu.set_cpu_spin(spin_mode_from_env() == "auto")
        _apply_malloc_mode(cpu)
        if info.CUDA_BUILT and _cuda_plugin_installed():
            _register("embark_jax._ffi_cuda", "CUDA")
        _registered_all = True


def _apply_malloc_mode(module) -> None:
    """EMBARK_MALLOC (core/cpu_env.py), once, when the kernels load."""
    global _MALLOC_MODE
    if malloc_mode_from_env() == "off":
        _MALLOC_MODE = "off"
    elif user_sets_malloc():
        _MALLOC_MODE = "user"
    else:
        done = int(module.tune_malloc())
        _MALLOC_MODE = {1: "tuned", 0: "unsupported"}.get(done, "refused")


def malloc_mode() -> str:
    """What loading the kernels did to glibc's malloc thresholds (docs/design.md §7): `tuned`
    (mmap threshold 32 MiB, trim threshold 64 MiB, the values glibc's own rule converges to),
    `off` (EMBARK_MALLOC=off), `user` (the process started with its own), `unsupported` (not
    glibc) or `refused` (glibc rejected a value: the trim threshold, or both, left as they
    were)."""
    ensure_registered()
    return _MALLOC_MODE


def registered_targets() -> dict[str, tuple[str, ...]]:
    """Platform -> sorted FFI target names registered by embark_jax (registers them first)."""
    ensure_registered()
    return {p: tuple(sorted(n)) for p, n in _REGISTERED.items()}


def build_info() -> dict[str, object]:
    """What the native build contains: jaxlib it was built against, CUDA part and archs."""
    info = _load_build_info()
    return {
        "jaxlib_built_against": info.JAXLIB_VERSION,
        "jaxlib_running": jaxlib.__version__,
        "cuda_built": bool(info.CUDA_BUILT),
        "cuda_architectures": info.CUDA_ARCHITECTURES,
        "registered": registered_targets(),
        "cpu_isa": cpu_isa(),
        "cpu_threads": cpu_threads(),
        "huge_pages": huge_page_mode(),
        "malloc": malloc_mode(),
        "cpu_spin": "auto" if _cpu_module().cpu_spin() else "off",
    }


def _cpu_module():
    ensure_registered()
    return importlib.import_module("embark_jax._ffi_cpu")


def cpu_isa() -> dict[str, str]:
    """The SIMD instruction set of the CPU kernels: `{"active": ..., "best": ...}`, each one of
    `scalar`, `avx2`, `avx512`, `avx512bf16` (AVX-512 with the BF16 conversions, which
    `lookup_pool`'s bfloat16 outputs use; docs/design.md §7)."""
    m = _cpu_module()
    return {"active": m.cpu_isa(), "best": m.best_cpu_isa()}


def set_cpu_isa(name: str) -> str:
    """Makes the CPU kernels use instruction set `name` (`auto` = the best this CPU supports)
    from their next call on, and returns the previous one. Compiled programs need no retrace:
    the kernels choose at each call. `EMBARK_CPU_ISA` does the same for a whole process.
    Raises ValueError for an unknown name or one this CPU does not support."""
    m = _cpu_module()
    previous = m.cpu_isa()
    key = str(name).strip().lower()
    if key == "auto":
        key = m.best_cpu_isa()
    if key not in CPU_ISAS:
        raise ValueError(f"cpu isa must be auto or one of {', '.join(CPU_ISAS)}; got {name!r}")
    m.set_cpu_isa(key)
    return previous


def cpu_threads() -> int:
    """Threads each CPU kernel runs on, its caller included: the CPUs this process may use, or
    `EMBARK_CPU_THREADS` (docs/design.md §7)."""
    return int(_cpu_module().cpu_threads())


def huge_page_mode() -> str:
    """`auto` (the kernels move the tables they read at random onto transparent huge pages, in
    the background, the second time they see one) or `off` (docs/design.md §7)."""
    return str(_cpu_module().huge_page_mode())


def set_huge_page_mode(mode: str) -> str:
    """Sets the mode from the next kernel call on (`auto`, also `on`/`1`; `off`, also `0`, as
    `EMBARK_HUGEPAGES` takes them for a whole process) and returns the previous one.
    ValueError for another name."""
    key = parse_huge_page_mode(mode)
    if key is None:
        raise ValueError(f"huge page mode must be auto, on, 1, off or 0; got {mode!r}")
    m = _cpu_module()
    previous = str(m.huge_page_mode())
    m.set_huge_page_mode(key == "auto")
    return previous


def huge_pages(array: jax.Array) -> int:
    """Moves the CPU buffers of `array` (each addressable shard on a CPU device) onto
    transparent huge pages now, and returns the bytes advised: the 2 MiB-aligned interior of
    each buffer of at least 8 MiB (pages already huge count too; small arrays and arrays on
    other devices give 0; 2 MiB regions never written, which cannot be collapsed, are left out
    and get huge pages when first written). The data is unchanged. Raises OSError with the OS's
    reason when it refuses (THP switched off, a kernel before Linux 6.1), TypeError for anything
    but a `jax.Array`. Auto mode does the same in the background; this is for doing it before a
    timed loop."""
    if not isinstance(array, jax.Array):
        raise TypeError(f"huge_pages: array must be a jax.Array; got {type(array).__name__}")
    m = _cpu_module()
    array.block_until_ready()  # its pages exist only once it is computed
    total = 0
    for shard in array.addressable_shards:
        if shard.device.platform != "cpu":
            continue
        data = shard.data
        got = int(m.advise_huge_pages(data.unsafe_buffer_pointer(), data.nbytes))
        if got < 0:
            raise OSError(-got, f"huge_pages: madvise refused: {os.strerror(-got)}")
        total += got
    return total


def huge_page_stats() -> dict[str, int]:
    """What auto mode did in this process: advice requests `queued` for the background thread
    (a table again each time it is re-checked), of those `advised` and `failed`, the `bytes`
    the successful ones covered (already huge ones included), and the `last_error` (errno) of
    a failure."""
    return {k: int(v) for k, v in _cpu_module().huge_page_stats().items()}


def wait_huge_pages(timeout_s: float = 60.0) -> bool:
    """Waits, at most `timeout_s` seconds, until auto mode's background thread has handled every
    table queued so far; returns whether it had."""
    return bool(_cpu_module().wait_huge_pages(min(max(float(timeout_s), 0.0), 1e6)))
