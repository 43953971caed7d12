"""Loads the compiled kernels and registers them as XLA FFI targets.

`_ffi_cpu` is always built; its targets are registered for `platform="cpu"`. `_ffi_cuda` is
built when nvcc was found; its targets (same names) are registered for `platform="CUDA"` when
a JAX CUDA plugin is installed. Registration never initialises a JAX backend, so importing
embark_jax before `jax.config.update("jax_num_cpu_devices", 8)` is fine.
"""

from __future__ import annotations

import importlib
import importlib.util
import re

import jax
import jaxlib

__all__ = ["NativeBuildError", "build_info", "registered_targets"]

_REGISTERED: dict[str, set[str]] = {}


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
    module = importlib.import_module(module_name)
    names = _REGISTERED.setdefault(platform, set())
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
        names.add(name)


def _register_all() -> None:
    info = _load_build_info()
    _check_ffi_version(info.JAXLIB_VERSION)
    _register("embark_jax._ffi_cpu", "cpu")
    if info.CUDA_BUILT and _cuda_plugin_installed():
        _register("embark_jax._ffi_cuda", "CUDA")


def registered_targets() -> dict[str, tuple[str, ...]]:
    """Platform -> sorted FFI target names registered by embark_jax."""
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
    }


_register_all()
