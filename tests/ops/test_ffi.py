"""`embark_jax.ops._ffi`: the thin `ffi_call` wrappers (their result types and scratch
outputs; each kernel's results: tests/xla_ffi)."""

import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax.ops import _ffi


def test_result_type_has_the_shape_and_dtype_asked_never_a_weak_type():
    weak = jnp.asarray(2.0) * 3  # a weakly typed scalar: its type must not leak into results
    r = _ffi.result_type(weak, (3, 5), jnp.bfloat16)
    assert (r.shape, r.dtype, getattr(r, "weak_type", False)) == ((3, 5), jnp.bfloat16, False)


def test_the_cpu_needs_one_byte_of_scratch():
    if _ffi.on_gpu():
        pytest.skip("CPU only")
    w = _ffi._workspace(jnp.ones((3,)), 1 << 20)
    assert (w.shape, w.dtype) == ((1,), jnp.uint8)


def test_segment_sum_call_sums_and_drops_outside_ids():
    v = jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2)
    got = _ffi.segment_sum(v, jnp.asarray([1, -1, 1, 5], jnp.int32), 2)
    np.testing.assert_array_equal(got, [[0, 0], [4, 6]])
