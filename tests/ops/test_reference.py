import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax.ops import reference
from tests import numpy_ref
from tests.numpy_ref import BF16_ROUNDING

pytestmark = pytest.mark.smoke

COMBINERS = ["sum", "mean", "sqrtn", "none"]


def _bags(rng, num_bags=6, hot=4, vocab=20, empty_bag=True):
    ids = rng.integers(0, vocab, size=(num_bags, hot))
    ids[rng.random((num_bags, hot)) < 0.3] = -1  # padding
    if empty_bag:
        ids[2] = -1
    seg = np.repeat(np.arange(num_bags), hot)
    return ids.reshape(-1), seg


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_pool_matches_numpy(rng, combiner, weighted):
    table = rng.normal(size=(20, 5)).astype(np.float32)
    ids, seg = _bags(rng)
    w = rng.uniform(0.1, 2.0, size=ids.shape).astype(np.float32) if weighted else None
    got = reference.lookup_pool(
        jnp.asarray(table),
        jnp.asarray(ids),
        jnp.asarray(seg),
        6,
        None if w is None else jnp.asarray(w),
        combiner,
    )
    want = numpy_ref.lookup_pool(table, ids, seg, 6, w, combiner)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    if combiner != "none":
        np.testing.assert_array_equal(np.asarray(got)[2], 0.0)  # empty bag


@pytest.mark.parametrize("combiner", COMBINERS)
def test_lookup_pool_grads_match_numpy(rng, combiner):
    table = rng.normal(size=(20, 3)).astype(np.float32)
    ids, seg = _bags(rng)
    w = rng.uniform(0.5, 1.5, size=ids.shape).astype(np.float32)
    nseg = 6
    cot = rng.normal(size=(nseg if combiner != "none" else ids.shape[0], 3)).astype(np.float32)

    def f(t, wt):
        return jnp.sum(
            reference.lookup_pool(t, jnp.asarray(ids), jnp.asarray(seg), nseg, wt, combiner) * cot
        )

    gt, gw = jax.grad(f, argnums=(0, 1))(jnp.asarray(table), jnp.asarray(w))

    # numpy central differences on a float64 copy of the function
    def fn(t, wt):
        return float(np.sum(numpy_ref.lookup_pool(t, ids, seg, nseg, wt, combiner) * cot))

    eps = 1e-6
    num_gw = np.zeros_like(w, np.float64)
    for i in range(len(w)):
        wp, wm = w.astype(np.float64), w.astype(np.float64)
        wp[i] += eps
        wm[i] -= eps
        num_gw[i] = (fn(table, wp) - fn(table, wm)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(gw), num_gw, rtol=1e-3, atol=1e-4)
    # table grad is linear in the table: the analytic numpy form
    if combiner in ("sum", "none"):
        want = np.zeros_like(table, np.float64)
        for i, x in enumerate(ids):
            if x >= 0:
                row = cot[seg[i]] if combiner == "sum" else cot[i]
                want[x] += w[i] * row
        np.testing.assert_allclose(np.asarray(gt), want, rtol=1e-5, atol=1e-5)
    else:
        num_gt = np.zeros_like(table, np.float64)
        for r in range(table.shape[0]):
            for c in range(table.shape[1]):
                tp, tm = table.astype(np.float64), table.astype(np.float64)
                tp[r, c] += eps
                tm[r, c] -= eps
                num_gt[r, c] = (fn(tp, w) - fn(tm, w)) / (2 * eps)
        np.testing.assert_allclose(np.asarray(gt), num_gt, rtol=1e-3, atol=1e-4)


def test_lookup_pool_bf16_table_returns_bf16(rng):
    table = jnp.asarray(rng.normal(size=(10, 4)), jnp.bfloat16)
    out = reference.lookup_pool(table, jnp.array([1, 2, -1]), jnp.array([0, 0, 1]), 2)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out, np.float32)[0],
        np.asarray(table[1], np.float32) + np.asarray(table[2], np.float32),
        rtol=BF16_ROUNDING,  # summed in float32 (exact for two bfloat16 values), rounded once
    )


@pytest.mark.parametrize("capacity", [3, 8, 30])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_unique_matches_numpy(rng, capacity, dtype):
    ids = rng.integers(-1, 12, size=25).astype(dtype)
    got = reference.unique(jnp.asarray(ids), capacity)
    want = numpy_ref.unique(ids, capacity)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    overflow = max(int(got[3]) - capacity, 0)
    assert overflow == max(len({int(x) for x in ids if x >= 0}) - capacity, 0)


def test_unique_empty_and_all_padding():
    u, inv, c, n = reference.unique(jnp.full((4,), -1, jnp.int32), 2)
    np.testing.assert_array_equal(u, [-1, -1])
    np.testing.assert_array_equal(inv, [-1] * 4)
    assert int(n) == 0 and int(c.sum()) == 0


def test_unique_keeps_the_largest_id_of_the_dtype():
    """The largest id of the dtype is kept, as the kernels keep it (iinfo.max is not a
    padding sentinel)."""
    ids = np.array([2**31 - 1, -1, 3, 2**31 - 1, -5, 0], np.int32)
    got = reference.unique(jnp.asarray(ids), 4)
    for g, w in zip(got, numpy_ref.unique(ids, 4), strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert np.asarray(got[0]).tolist() == [0, 3, 2**31 - 1, -1]


def test_segment_sum_matches_numpy_and_drops_out_of_range(rng):
    v = rng.normal(size=(30, 4)).astype(np.float32)
    seg = rng.integers(-2, 9, size=30)
    got = reference.segment_sum(jnp.asarray(v), jnp.asarray(seg), 7)
    np.testing.assert_allclose(
        np.asarray(got), numpy_ref.segment_sum(v, seg, 7), rtol=1e-5, atol=1e-6
    )
    g = jax.grad(lambda x: jnp.sum(reference.segment_sum(x, jnp.asarray(seg), 7) ** 2))(
        jnp.asarray(v)
    )
    want = np.array([2 * np.asarray(got)[s] if 0 <= s < 7 else np.zeros(4) for s in seg])
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)
