"""Gradients of `lookup_pool` against an independent numpy derivation (float64 loops, the
closed-form derivative of each combiner), itself checked by finite differences. The FFI
forward's custom VJP is `jax.vjp` of the jnp reference, so comparing it with the reference
(test_kernels.test_lookup_pool_grads_wiring) only checks the wiring; this file checks the
maths, for the dense VJP and for the sparse backward kernels (`lookup_pool_backward`, the
fused update)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import ops
from embark_jax.ops import optimizers as O
from tests import numpy_ref
from tests.xla_ffi.test_kernels import COMBINERS, bags

pytestmark = pytest.mark.smoke

V, D, S = 40, 8, 12


def numpy_grads(table, ids, seg, num_segments, w, combiner, cot):
    """d(sum(lookup_pool(...) * cot)) / d(table, weights), derived by hand."""
    table = np.asarray(table, np.float64)
    w = np.asarray(w, np.float64)
    cot = np.asarray(cot, np.float64)
    g_table, g_w = np.zeros_like(table), np.zeros_like(w)
    valid = [0 <= x < table.shape[0] for x in ids]
    if combiner == "none":
        for i, x in enumerate(ids):
            if valid[i]:
                g_table[x] += w[i] * cot[i]
                g_w[i] = table[x] @ cot[i]
        return g_table, g_w
    denom = np.zeros(num_segments)
    for i, s in enumerate(seg):
        if valid[i] and 0 <= s < num_segments:
            denom[s] += w[i] ** 2 if combiner == "sqrtn" else w[i]
    if combiner == "sqrtn":
        denom = np.sqrt(denom)
    if combiner == "sum":
        denom = np.ones(num_segments)
    out = numpy_ref.lookup_pool(table, ids, seg, num_segments, w, combiner)
    for i, (x, s) in enumerate(zip(ids, seg, strict=True)):
        if not valid[i] or not 0 <= s < num_segments or denom[s] == 0:
            continue
        g_table[x] += w[i] / denom[s] * cot[s]
        if combiner == "sum":
            g_w[i] = table[x] @ cot[s]
        elif combiner == "mean":  # out = sum(w r) / sum(w)
            g_w[i] = (table[x] - out[s]) @ cot[s] / denom[s]
        else:  # sqrtn: out = sum(w r) / sqrt(sum(w^2))
            g_w[i] = (table[x] - out[s] * w[i] / denom[s]) @ cot[s] / denom[s]
    return g_table, g_w


def _problem(rng, combiner):
    table = rng.normal(size=(V, D))
    ids, seg = bags(rng, b=S, vocab=V)
    ids[0] = V + 2  # >= V: padding
    w = rng.uniform(0.2, 2.0, size=ids.shape)
    n_out = ids.shape[0] if combiner == "none" else S
    cot = rng.normal(size=(n_out, D))
    return table, ids, seg, w, cot


@pytest.mark.parametrize("combiner", COMBINERS)
def test_numpy_gradient_matches_finite_differences(rng, combiner):
    table, ids, seg, w, cot = _problem(rng, combiner)
    g_table, g_w = numpy_grads(table, ids, seg, S, w, combiner, cot)

    def loss(t, wt):
        return np.sum(numpy_ref.lookup_pool(t, ids, seg, S, wt, combiner) * cot)

    eps = 1e-6
    for i in [0, 1, 2, 5, 9, 20, 40]:  # several weights; index 0 is padding (id >= V)
        dw = np.zeros_like(w)
        dw[i] = eps
        fd = (loss(table, w + dw) - loss(table, w - dw)) / (2 * eps)
        assert g_w[i] == pytest.approx(fd, rel=1e-5, abs=1e-7), i
    for r in {int(ids[1]), int(ids[7]), 39}:
        if not 0 <= r < V:
            continue
        dt = np.zeros_like(table)
        dt[r, 3] = eps
        fd = (loss(table + dt, w) - loss(table - dt, w)) / (2 * eps)
        assert g_table[r, 3] == pytest.approx(fd, rel=1e-5, abs=1e-7), r


@pytest.mark.parametrize("combiner", COMBINERS)
def test_ffi_dense_gradient_matches_numpy(rng, combiner):
    table, ids, seg, w, cot = _problem(rng, combiner)
    want_t, want_w = numpy_grads(table, ids, seg, S, w, combiner, cot)

    def loss(t, wt):
        out = ops.lookup_pool(t, ids, seg, S, wt, combiner, backend="ffi")
        return jnp.sum(out * jnp.asarray(cot, jnp.float32))

    g_t, g_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        jnp.asarray(table, jnp.float32), jnp.asarray(w, jnp.float32)
    )
    np.testing.assert_allclose(np.asarray(g_t), want_t, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_w), want_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_sparse_backward_matches_numpy(rng, combiner, backend):
    table, ids, seg, w, cot = _problem(rng, combiner)
    want_t, _ = numpy_grads(table, ids, seg, S, w, combiner, cot)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    rows, grads, overflow = jax.jit(
        functools.partial(
            ops.lookup_pool_backward,
            capacity=64,
            combiner=combiner,
            vocab_size=V,
            backend=backend,
        )
    )(f32(cot), jnp.asarray(ids), jnp.asarray(seg), f32(w))
    assert int(overflow) == 0
    rows, grads = np.asarray(rows), np.asarray(grads)
    valid = rows >= 0
    rebuilt = np.zeros((V, D))
    rebuilt[rows[valid]] = grads[valid]
    np.testing.assert_allclose(rebuilt, want_t, rtol=1e-5, atol=1e-5)

    # the fused backward + SGD moves each row by -lr times the same numpy gradient
    opt = O.SGD(learning_rate=0.5)
    t0 = f32(table)
    new_t, _, num = ops.lookup_pool_backward_update(
        t0,
        opt.init(t0),
        f32(cot),
        jnp.asarray(ids),
        jnp.asarray(seg),
        f32(w),
        optimizer=opt,
        combiner=combiner,
        backend=backend,
    )
    assert int(num) == np.count_nonzero(np.abs(want_t).sum(1))
    np.testing.assert_allclose(np.asarray(new_t), table - 0.5 * want_t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_a_bag_of_zero_weights_has_finite_gradients(combiner):
    """Its output is 0 whatever the weights; sqrt's infinite slope at 0 gave sqrtn NaNs."""
    t = jnp.ones((5, 4))
    ids, seg = jnp.arange(4, dtype=jnp.int32), jnp.asarray([0, 0, 1, 1], jnp.int32)
    w = jnp.asarray([1.0, 0.5, 0.0, 0.0])
    g_t, g_w = jax.grad(
        lambda t, w: ops.lookup_pool(t, ids, seg, 2, w, combiner).sum(), argnums=(0, 1)
    )(t, w)
    assert np.isfinite(np.asarray(g_t)).all() and np.isfinite(np.asarray(g_w)).all()
    np.testing.assert_array_equal(np.asarray(g_w)[2:], 0.0)


@pytest.mark.parametrize("backend", ["ffi", "reference"])
@pytest.mark.parametrize("rows", [3, 5])
def test_backward_with_combiner_none_needs_a_gradient_row_per_id(backend, rows):
    """`none` pools nothing: the gradient has a row per id, and a gradient with fewer rows
    (an id's gradient dropped) or more is refused in one line naming both counts."""
    ids = jnp.array([0, 1, 2, 3], jnp.int32)
    g = jnp.ones((rows, 2), jnp.float32)
    msg = f"combiner 'none' needs an output gradient row per id: got {rows} rows for 4 ids"
    with pytest.raises(ValueError, match=msg):
        ops.lookup_pool_backward(g, ids, None, capacity=4, combiner="none", backend=backend)
    t = jnp.ones((6, 2), jnp.float32)
    opt = O.SGD(learning_rate=1.0)
    with pytest.raises(ValueError, match=msg):
        ops.stage_backward_update(
            t, opt.init(t), g, ids, None, optimizer=opt, combiner="none", backend=backend
        )


def test_backward_of_no_bags_updates_nothing_on_both_backends():
    """A gradient of no bags (S = 0) with ids present: every id's bag is outside, so no row
    is touched, on the kernels and on the reference (which took rows of an empty array)."""
    t = jnp.ones((6, 4), jnp.float32)
    opt = O.RowWiseAdagrad(learning_rate=0.1)
    ids, seg = jnp.array([0, 1, 2]), jnp.array([0, 0, 1])
    for backend in ("ffi", "reference"):
        got = ops.stage_backward_update(
            t, opt.init(t), jnp.zeros((0, 4)), ids, seg, optimizer=opt, backend=backend
        )
        np.testing.assert_array_equal(got.table, t)
        assert int(got.num_unique) == 0
