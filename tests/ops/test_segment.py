"""`embark_jax.ops.segment.segment_sum`: the wrapper's checks, its dtype dispatch and its
gradient (the kernel itself: tests/xla_ffi/test_segment_sum.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax.ops.segment import segment_sum


def test_values_and_segment_ids_must_agree_in_length():
    with pytest.raises(ValueError, match=r"segment_ids shape \(3,\) must be \[N\] for values"):
        segment_sum(jnp.ones((4, 2)), jnp.zeros((3,), jnp.int32), 2)


def test_a_dtype_the_kernel_lacks_runs_on_the_reference():
    v = jnp.asarray([[1.0], [2.0], [4.0]], jnp.float16)
    got = segment_sum(v, jnp.asarray([1, 1, 0]), 2)
    assert got.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got, np.float32), [[4.0], [3.0]])


def test_the_gradient_reads_each_value_its_segment_and_drops_the_rest():
    v = jnp.ones((5, 2), jnp.float32)
    seg = jnp.asarray([0, 2, -1, 2, 3])  # -1 and 3 are outside [0, 3)
    w = jnp.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    g = jax.grad(lambda x: jnp.sum(segment_sum(x, seg, 3, backend="ffi") * w))(v)
    np.testing.assert_array_equal(g, [[1, 2], [5, 6], [0, 0], [5, 6], [0, 0]])
