"""`embark_jax.ops.native`: loading the kernels, registering their targets, and the jaxlib
version check."""

import jaxlib
import pytest

import embark_jax
from embark_jax.ops import native

pytestmark = pytest.mark.smoke


def test_cpu_targets_are_registered():
    # registered_targets() registers on first use (BUILD.md); nothing registers at import.
    targets = embark_jax.registered_targets()
    assert "embark_segment_sum" in targets["cpu"]
    assert set(targets["cpu"]) >= {
        "embark_lookup_pool",
        "embark_unique",
        "embark_sparse_grad",
        "embark_sparse_update",
        "embark_sparse_grad_update",
    }
    info = embark_jax.build_info()
    assert info["jaxlib_built_against"] == info["jaxlib_running"]


def test_version_tuple_reads_the_first_three_numbers():
    assert native._version_tuple("0.8.1.dev20250101") == (0, 8, 1)
    assert native._version_tuple("jaxlib 0.7") == (0, 7)


def test_kernels_built_against_a_newer_jaxlib_are_refused_with_the_fix():
    native._check_ffi_version(jaxlib.__version__)  # the same version: fine
    major, minor, *_ = native._version_tuple(jaxlib.__version__)
    with pytest.raises(native.NativeBuildError, match="Rebuild against the installed jaxlib"):
        native._check_ffi_version(f"{major}.{minor + 1}.0")
    assert issubclass(native.NativeBuildError, ImportError)
