"""`embark_jax.ops.ids`: one rule for ids and segment ids in every op. Narrow integer ids
are widened, host ids are converted by value where they fit, and anything that would wrap,
or is not a 1-D integer array, is refused by name."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import ops
from embark_jax.ops import optimizers as O
from tests.xla_ffi.test_kernels import x64

pytestmark = pytest.mark.smoke


def test_host_int64_ids_beyond_int32_are_refused_not_wrapped():
    """With 64-bit JAX types off, converting 2**33 to int32 would give 0, a real row."""
    if jax.config.jax_enable_x64:
        pytest.skip("64-bit types on: the ids stay int64")
    t = jnp.ones((10, 8))
    ids = np.array([1, 2**33, 2, 3], np.int64)
    seg = np.array([0, 0, 1, 1], np.int64)
    msg = "id 8589934592 is outside int32 and JAX's 64-bit types are off"
    with pytest.raises(ValueError, match=f"lookup_pool: ids: {msg}"):
        ops.lookup_pool(t, ids, seg, 2)
    with pytest.raises(ValueError, match=f"lookup_pool_backward: ids: {msg}"):
        ops.lookup_pool_backward(jnp.ones((2, 8)), ids, seg, capacity=4)
    with pytest.raises(ValueError, match=f"unique: ids: {msg}"):
        ops.unique(ids, 4)
    with pytest.raises(ValueError, match="segment_sum: segment_ids: id -8589934592 is outside"):
        ops.segment_sum(jnp.ones((4, 8)), np.array([0, 0, 1, -(2**33)], np.int64), 2)
    small = np.array([1, 4, 2, 3], np.int64)  # in range: converted as before
    np.testing.assert_array_equal(
        np.asarray(ops.lookup_pool(t, small, seg, 2)), np.full((2, 8), 2.0)
    )


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16])
def test_narrow_integer_ids_are_widened_to_int32(dtype):
    """The kernels take int32/int64; narrower ids give the int32 result on every id op."""
    t = jnp.arange(40.0).reshape(10, 4)
    ids, seg = np.array([1, 9, 3, 9, 1], dtype), np.array([0, 0, 1, 1, 2], dtype)
    i32, s32 = ids.astype(np.int32), seg.astype(np.int32)
    for host in (True, False):
        i, s = (ids, seg) if host else (jnp.asarray(ids), jnp.asarray(seg))
        np.testing.assert_array_equal(ops.lookup_pool(t, i, s, 3), ops.lookup_pool(t, i32, s32, 3))
        got, want = ops.unique(i, 4), ops.unique(i32, 4)
        assert got[0].dtype == jnp.int32
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(ops.segment_sum(t[:5], s, 3), ops.segment_sum(t[:5], s32, 3))


def test_unsigned_ids_that_would_wrap_are_refused():
    """uint32 on the device has no exact int32 form without 64-bit types: refused by name."""
    if jax.config.jax_enable_x64:
        pytest.skip("64-bit types on: uint32 ids widen to int64")
    t, seg = jnp.ones((10, 4)), jnp.asarray([0, 0, 1, 1], jnp.int32)
    ids = jnp.asarray([1, 2, 3, 9], jnp.uint32)
    with pytest.raises(ValueError, match="lookup_pool: ids: uint32 ids would wrap"):
        ops.lookup_pool(t, ids, seg, 2)
    with pytest.raises(ValueError, match="segment_sum: segment_ids: uint32 ids would wrap"):
        ops.segment_sum(t[:4], ids, 2)
    with pytest.raises(ValueError, match="unique: ids: uint32 ids would wrap"):
        ops.unique(ids, 4)
    host = np.array([1, 2, 3, 9], np.uint32)  # host values that fit int32: converted by value
    np.testing.assert_array_equal(ops.lookup_pool(t, host, seg, 2), np.full((2, 4), 2.0))
    with pytest.raises(ValueError, match="lookup_pool: ids: id 2147483648 is outside int32"):
        ops.lookup_pool(t, np.array([1, 2**31, 3, 9], np.uint32), seg, 2)


def _sgd_update(ids, seg, backend=None):
    opt = O.SGD(learning_rate=1.0)
    t = jnp.zeros((4, 2))
    g = jnp.ones((2, 2))
    return ops.lookup_pool_backward_update(
        t, opt.init(t), g, ids, seg, optimizer=opt, backend=backend
    )


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_every_op_checks_ids_and_segment_ids_by_name(backend):
    """One rule for both id arrays of every op: bool, 2-D or float ids and segment ids are
    refused by name in the wrapper, not taken (and rows updated), nor failed in the kernel
    under its target's name or inside jnp."""
    g, i3, s3 = jnp.ones((2, 2)), np.array([0, 1, 2]), np.array([0, 0, 1])
    cases = {
        "lookup_pool_backward_update: ids must be integers, got bool": lambda: _sgd_update(
            np.array([True, False, True]), s3, backend
        ),
        "lookup_pool_backward_update: ids: expected a 1-D array": lambda: _sgd_update(
            np.array([[0, 1], [2, 3]]), np.array([[0, 0], [1, 1]]), backend
        ),
        "lookup_pool_backward_update: ids must be integers, got float64": lambda: _sgd_update(
            i3.astype(np.float64), s3, backend
        ),
        "lookup_pool_backward_update: segment_ids: expected a 1-D array of 3 ids": (
            lambda: _sgd_update(i3, s3[:2], backend)
        ),
        "lookup_pool_backward: segment_ids: expected a 1-D array of 4 ids": (
            lambda: ops.lookup_pool_backward(
                g, np.arange(4), np.array([[0, 0], [1, 1]]), capacity=4, backend=backend
            )
        ),
        "lookup_pool_backward: segment_ids must be integers, got float64": (
            lambda: ops.lookup_pool_backward(
                g, i3, s3.astype(np.float64), capacity=4, backend=backend
            )
        ),
        "segment_sum: segment_ids must be integers, got bool": lambda: ops.segment_sum(
            jnp.ones((3, 1)), s3.astype(bool), 2, backend=backend
        ),
        "unique: ids: a value is not an integer in int64's range": lambda: ops.unique(
            [1, 2**70], 2, backend=backend
        ),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            call()


def test_lists_of_big_ints_and_of_tracers():
    with pytest.raises(ValueError, match="unique: ids: a value is not an integer in int64"):
        ops.unique([1, 2**63, 3], 4)  # not numpy's "must be integers, got float64"
    got = jax.jit(lambda a, b: ops.unique([a, b, a], 2))(jnp.int32(4), jnp.int32(1))
    np.testing.assert_array_equal(got[0], [1, 4])  # no TracerArrayConversionError


def test_lists_and_empty_host_arrays_are_ids():
    """An empty list was float32 (refused), and an empty host uint32 array was refused
    while a non-empty one was taken."""
    want = ops.unique(jnp.asarray([3, 1, 3], jnp.int32), 2)
    for g, w in zip(ops.unique([3, 1, 3], 2), want, strict=True):
        np.testing.assert_array_equal(g, w)
    empty = ops.unique(jnp.zeros((0,), jnp.int32), 2)
    for ids in ([], (), np.zeros(0, np.uint32), np.zeros(0, np.uint64), np.zeros(0, np.int64)):
        for g, w in zip(ops.unique(ids, 2), empty, strict=True):
            np.testing.assert_array_equal(g, w)
    if not jax.config.jax_enable_x64:
        with pytest.raises(ValueError, match="unique: ids: id 2147483648 is outside int32"):
            ops.unique([1, 2**31], 2)  # not a bare OverflowError


def test_host_uint32_ids_widen_to_int64_with_64_bit_types():
    """Host uint32 ids are taken as the same device array is, not refused as 'outside
    int32'."""
    with x64(True):
        got = ops.unique(np.array([1, 3_000_000_000, 1], np.uint32), 2)
        assert got[0].dtype == jnp.int64 and got[3].dtype == jnp.int32
        np.testing.assert_array_equal(got[0], [1, 3_000_000_000])
        ref = ops.unique(jnp.array([1, 3_000_000_000, 1], jnp.uint32), 2, backend="reference")
        assert ref[3].dtype == jnp.int32  # num_unique: int32 on both backends


def test_as_ids_checks_rank_and_length_and_widens_narrow_types():
    from embark_jax.ops.ids import as_ids

    got = as_ids("op: ids", np.array([1, 2], np.int8), n=2)
    assert got.dtype == jnp.int32 and got.tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"^op: ids: expected a 1-D array of 3 ids, got shape"):
        as_ids("op: ids", np.array([1, 2]), n=3)
    with pytest.raises(ValueError, match=r"^op: ids: not a rectangular array of ids"):
        as_ids("op: ids", [[1, 2], [3]])


def test_host_ids_keeps_narrow_types_and_converts_wide_ones_by_value():
    from embark_jax.ops.ids import host_ids

    narrow = np.array([1, 2], np.int16)
    assert host_ids("ids", narrow) is narrow  # widened on the device
    if not jax.config.jax_enable_x64:
        got = host_ids("ids", np.array([2**31 - 1], np.int64))
        assert got.dtype == np.int32 and got[0] == 2**31 - 1
        with pytest.raises(ValueError, match="ids: id -2147483649 is outside int32"):
            host_ids("ids", np.array([-(2**31) - 1], np.int64))
