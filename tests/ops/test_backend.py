"""`embark_jax.ops.backend`: which implementation an op runs, per call or per block."""

import pytest

from embark_jax.ops.backend import Backend, current_backend, resolve, use_backend


def test_ffi_is_the_default_and_a_block_sets_it_until_it_ends():
    assert current_backend() is Backend.FFI
    with use_backend("Reference"):
        assert current_backend() is Backend.REFERENCE
        with use_backend(Backend.FFI):
            assert resolve(None) is Backend.FFI
        assert resolve(None) is Backend.REFERENCE
        assert resolve("ffi") is Backend.FFI  # a per-call choice wins over the block
    assert current_backend() is Backend.FFI


def test_the_block_is_reset_when_it_raises():
    with pytest.raises(RuntimeError), use_backend("reference"):
        raise RuntimeError
    assert current_backend() is Backend.FFI


def test_an_unknown_backend_is_one_line():
    assert Backend.parse(None) is None
    with pytest.raises(ValueError, match="unknown backend 'xla'; expected one of: ffi, reference"):
        use_backend("xla").__enter__()
