"""Contracts the CPU and CUDA kernels share, checked on whichever backend runs the tests (the
CPU here, the GPU under experiments/gpu_check.sh):

- `indices_are_sorted` is a hint: both kernels check the order themselves, so unsorted
  segment ids with the flag set still give the right bags (only more slowly);
- the sorted pooling path handles segment ids outside [0, S), empty bags, padding and ids
  >= V, at every width class (the CUDA kernel picks 8, 16 or 32 lanes per row and scalar or
  4-wide loads from D);
- bfloat16 sums are added in float32 and rounded once (segment_sum, pooling)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import ops
from embark_jax.ops import optimizers as O
from tests import numpy_ref
from tests.xla_ffi.test_kernels import x64

pytestmark = pytest.mark.smoke

POOLED = ["sum", "mean", "sqrtn"]


def _sorted_bags(rng, b, h, vocab, id_dtype=np.int32):
    ids = rng.integers(0, vocab + 3, size=(b, h))  # some ids >= V: padding
    ids[rng.random((b, h)) < 0.2] = -1
    ids[b // 2] = -1  # an empty bag
    lengths = rng.integers(0, h + 1, size=b)  # ragged bags, some of length 0
    seg = np.concatenate([np.full(n, s) for s, n in enumerate(lengths)])
    ids = np.concatenate([ids[s, :n] for s, n in enumerate(lengths)])
    return ids.astype(id_dtype), seg.astype(np.int32)


@pytest.mark.parametrize("combiner", POOLED)
@pytest.mark.parametrize("id64", [False, True])
@pytest.mark.parametrize("table_dtype", [jnp.float32, jnp.bfloat16])
def test_sorted_hint_with_unsorted_ids_gives_the_right_bags(rng, combiner, id64, table_dtype):
    with x64(id64):
        table = rng.normal(size=(50, 16)).astype(np.float32)
        ids, seg = _sorted_bags(rng, 20, 6, 50, np.int64 if id64 else np.int32)
        perm = rng.permutation(ids.shape[0])
        ids, seg = ids[perm], seg[perm]
        assert np.any(np.diff(seg) < 0)
        w = rng.uniform(0.2, 2.0, size=ids.shape).astype(np.float32)
        t = jnp.asarray(table, table_dtype)
        got = jax.jit(
            lambda t, i, s, w: ops.lookup_pool(t, i, s, 20, w, combiner, indices_are_sorted=True)
        )(t, jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(w))
        want = numpy_ref.lookup_pool(np.asarray(t, np.float32), ids, seg, 20, w, combiner)
        tol = 1e-5 if table_dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dim", [3, 8, 13, 16, 40, 64, 128, 200])
@pytest.mark.parametrize("table_dtype", [jnp.float32, jnp.bfloat16])
def test_sorted_path_every_width(rng, dim, table_dtype):
    table = jnp.asarray(rng.normal(size=(60, dim)), table_dtype)
    ids, seg = _sorted_bags(rng, 24, 40, 60)  # bags longer than a warp's 32 ids
    # segment ids outside [0, S) at both ends of the sorted order are dropped
    seg = np.concatenate([[-1, -1], seg, [24, 30]]).astype(np.int32)
    ids = np.concatenate([[1, 2], ids, [3, 4]]).astype(np.int32)
    w = rng.uniform(0.2, 2.0, size=ids.shape).astype(np.float32)
    for combiner in POOLED:
        got = ops.lookup_pool(
            table,
            jnp.asarray(ids),
            jnp.asarray(seg),
            24,
            jnp.asarray(w),
            combiner,
            indices_are_sorted=True,
            out_dtype=jnp.float32,
        )
        want = numpy_ref.lookup_pool(np.asarray(table, np.float32), ids, seg, 24, w, combiner)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4, err_msg=combiner)


def test_sorted_path_with_no_ids_and_all_padding():
    table = jnp.ones((10, 8), jnp.float32)
    empty = jnp.zeros((0,), jnp.int32)
    out = ops.lookup_pool(table, empty, empty, 5, None, "mean", indices_are_sorted=True)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((5, 8)))
    pad = jnp.array([-1, 10, 12, -5], jnp.int32)
    seg = jnp.array([0, 0, 2, 3], jnp.int32)
    out = ops.lookup_pool(table, pad, seg, 5, None, "sqrtn", indices_are_sorted=True)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((5, 8)))


def test_bf16_segment_sum_adds_in_float32():
    """1000 ones into one segment: 1000 (rounding after each bfloat16 add stops at 256)."""
    ones = jnp.ones((1000, 4), jnp.bfloat16)
    out = ops.segment_sum(ones, jnp.zeros((1000,), jnp.int32), 2)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[1000.0] * 4, [0.0] * 4])


def test_bf16_segment_sum_rounds_once(rng):
    v = jnp.asarray(rng.normal(size=(4000, 8)), jnp.bfloat16)
    seg = jnp.asarray(rng.integers(-1, 3, size=4000), jnp.int32)
    got = np.asarray(ops.segment_sum(v, seg, 3), np.float32)
    exact = numpy_ref.segment_sum(np.asarray(v, np.float64), np.asarray(seg), 3)
    # one rounding of a float32 sum: within half a bfloat16 ulp (2^-9 relative) plus a
    # little for the float32 adds; per-add rounding is off by far more on 1300 terms
    np.testing.assert_allclose(got, exact, rtol=2.0**-8, atol=1e-3)


def test_bf16_pooling_adds_in_float32():
    table = jnp.ones((4, 8), jnp.bfloat16)
    ids = jnp.zeros((1000,), jnp.int32)
    seg = jnp.zeros((1000,), jnp.int32)
    for srt in (True, False):
        out = ops.lookup_pool(table, ids, seg, 1, None, "sum", indices_are_sorted=srt)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((1, 8), 1000.0))


@pytest.mark.parametrize("bad", [-1, 2.0, True, "3"])
def test_lookup_pool_refuses_a_bad_num_segments(bad):
    t, i = jnp.ones((10, 8)), jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(
        ValueError, match=rf"lookup_pool: num_segments must be an int >= 0, got {bad!r}"
    ):
        ops.lookup_pool(t, i, i, bad)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_lookup_pool_refuses_a_table_or_output_that_is_not_float(dtype):
    t, i = jnp.ones((10, 8)), jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="lookup_pool: table must be a float type, got"):
        ops.lookup_pool(t.astype(dtype), i, i, 4)
    with pytest.raises(ValueError, match="lookup_pool: out_dtype must be a float type, got"):
        ops.lookup_pool(t, i, i, 4, out_dtype=dtype)


def test_the_fused_update_takes_grads_of_a_type_the_kernel_lacks():
    """float16 grads (float64 with 64-bit types) run on the reference, as in
    lookup_pool_backward, instead of reaching a kernel that refuses them at run time."""
    opt = O.SGD(learning_rate=1.0)
    t, ids, seg = jnp.zeros((4, 2)), np.array([0, 1, 2]), np.array([0, 0, 1])
    g = jnp.asarray([[1.0, 2.0], [3.0, 4.0]], jnp.float16)
    got, _, n = ops.lookup_pool_backward_update(t, opt.init(t), g, ids, seg, optimizer=opt)
    np.testing.assert_array_equal(got, [[-1, -2], [-1, -2], [-3, -4], [0, 0]])
    assert int(n) == 3


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_ids_of_bags_outside_the_output_get_no_gradient_on_either_backend(combiner):
    """The forward drops an id whose segment is outside [0, S); the reference backward
    (and so the fused update's reference, and float16 grads on the default backend) gave
    it the gradient of a clipped segment."""
    g = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
    ids, seg = jnp.asarray([1, 2, 3, 0]), jnp.asarray([0, -1, 1, 2])
    want = jax.grad(lambda t: (ops.lookup_pool(t, ids, seg, 2, combiner=combiner) * g).sum())(
        jnp.zeros((4, 2))
    )
    opt = O.SGD(learning_rate=1.0)
    t0 = jnp.zeros((4, 2))
    for backend in ("ffi", "reference"):
        rows, rg, _ = ops.lookup_pool_backward(
            g, ids, seg, capacity=4, combiner=combiner, backend=backend
        )
        dense = np.zeros((4, 2), np.float32)
        for r, x in zip(np.asarray(rows), np.asarray(rg), strict=True):
            if r >= 0:
                dense[r] += x
        np.testing.assert_array_equal(dense, want, err_msg=backend)
        t, _, _ = ops.lookup_pool_backward_update(
            t0, opt.init(t0), g, ids, seg, optimizer=opt, combiner=combiner, backend=backend
        )
        np.testing.assert_array_equal(t, -want, err_msg=backend)


def test_backward_inputs_are_checked_as_the_forward_checks_them():
    g, ids, seg = jnp.ones((2, 2)), jnp.asarray([1, 2, 3]), jnp.asarray([0, 0, 1])
    opt, t0 = O.SGD(learning_rate=1.0), jnp.zeros((4, 2))
    calls = {
        "lookup_pool_backward": lambda s, w: ops.lookup_pool_backward(g, ids, s, w, capacity=3),
        "lookup_pool_backward_update": lambda s, w: ops.lookup_pool_backward_update(
            t0, opt.init(t0), g, ids, s, w, optimizer=opt
        ),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=f"{op}: segment_ids are required for pooled"):
            call(None, None)  # not "a value is not an integer in int64's range"
        with pytest.raises(ValueError, match=re.escape(f"{op}: weights must be [N] = (3,)")):
            call(seg, jnp.ones(2))  # not a broadcasting error from jnp
    # `none` ignores segment ids, as documented: float ones too
    t = jnp.arange(8.0).reshape(4, 2)
    np.testing.assert_array_equal(
        ops.lookup_pool(t, ids, jnp.asarray([0.5, 0, 1]), 3, combiner="none"),
        ops.lookup_pool(t, ids, None, 3, combiner="none"),
    )


def test_a_padding_id_reads_no_row_in_the_reference():
    """Row 0 holding inf must not leak into a bag through a padding id (0 * inf = NaN)."""
    t = jnp.asarray([[np.inf, 1.0], [2.0, 3.0]], jnp.float32)
    ids, seg = jnp.asarray([-1, 1], jnp.int32), jnp.asarray([0, 0], jnp.int32)
    for backend in ("ffi", "reference"):
        got = np.asarray(ops.lookup_pool(t, ids, seg, 1, backend=backend))
        np.testing.assert_array_equal(got, [[2.0, 3.0]], err_msg=backend)


@pytest.mark.parametrize("combiner", [*POOLED, "none"])
def test_an_empty_table_gives_zeros_on_both_backends(combiner):
    t = jnp.zeros((0, 8), jnp.float32)
    ids, seg = jnp.asarray([0, 3, -1], jnp.int32), jnp.asarray([0, 0, 1], jnp.int32)
    for backend in ("ffi", "reference"):
        got = np.asarray(ops.lookup_pool(t, ids, seg, 2, combiner=combiner, backend=backend))
        assert got.shape == ((3, 8) if combiner == "none" else (2, 8))
        assert not got.any(), backend
