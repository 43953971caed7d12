"""GPU-only kernel checks (experiments/gpu_check.sh runs them with EMBARK_TEST_GPU=1; they
skip on CPU machines). The CPU kernel tests (tests/xla_ffi/test_kernels.py, tests/ops/test_kernel_contracts.py,
tests/ops/test_lookup.py) run on the GPU too; this file adds what only a GPU exercises: CUB's
multi-tile sort and scan (a million ids), hot ids with long runs, the CUDA workspaces, and a
distributed step inside shard_map on the GPU against the single-device reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embark_jax import ops
from embark_jax.ops import _ffi, abi, reference
from embark_jax.ops import optimizers as O
from tests import numpy_ref
from tests.xla_ffi.test_kernels import OPTIMIZERS, x64

pytestmark = pytest.mark.gpu

BIG = (1 << 20) + 17  # well past one CUB tile, not a multiple of anything


def _zipf_ids(rng, n, vocab, dtype=np.int32):
    ids = (rng.zipf(1.2, size=n) - 1) % vocab  # a few very hot ids: runs of 100k+
    ids[rng.random(n) < 0.05] = -1
    return ids.astype(dtype)


@pytest.mark.parametrize("id64", [False, True])
def test_unique_a_million_ids(id64):
    rng = np.random.default_rng(0)
    with x64(id64):
        ids = _zipf_ids(rng, BIG, 300_000, np.int64 if id64 else np.int32)
        if id64:
            ids[::1000] += 1 << 40  # ids past 32 bits sort by all 64
        cap = 50_000
        uniq, inverse, counts, num = jax.jit(functools.partial(ops.unique, capacity=cap))(
            jnp.asarray(ids)
        )
        vals, cnt = np.unique(ids[ids >= 0], return_counts=True)
        assert int(num) == len(vals)
        k = min(cap, len(vals))
        np.testing.assert_array_equal(np.asarray(uniq)[:k], vals[:k])
        np.testing.assert_array_equal(np.asarray(counts)[:k], cnt[:k])
        inv = np.asarray(inverse)
        ok = inv >= 0
        np.testing.assert_array_equal(np.asarray(uniq)[inv[ok]], ids[ok])
        dropped = ids[~ok]  # padding, or distinct ids past the capacity
        assert np.all((dropped < 0) | (dropped > vals[k - 1]))


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_fused_update_a_million_ids_with_hot_rows(opt):
    rng = np.random.default_rng(1)
    vocab, dim, b = 100_000, 64, 1 << 14
    hot = BIG // b
    ids = _zipf_ids(rng, b * hot, vocab)
    seg = np.repeat(np.arange(b, dtype=np.int32), hot)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(b, dim)), jnp.float32)
    args = (cot, jnp.asarray(ids), jnp.asarray(seg))
    kw = dict(optimizer=opt, combiner="mean")
    t1, s1, n1 = jax.jit(functools.partial(ops.lookup_pool_backward_update, **kw))(
        table, opt.init(table), *args
    )
    t2, s2, n2 = ops.lookup_pool_backward_update(
        table, opt.init(table), *args, backend="reference", **kw
    )
    assert int(n1) == int(n2) == len(np.unique(ids[ids >= 0]))
    # Hot rows sum ~10^4 float32 terms, in another order than XLA's reference (sorted runs and
    # warp reductions vs scatter-add); the first GPU run measured up to 3.4e-4 relative on
    # Adagrad's accumulators and 2.2e-4 absolute on an Adam weight, hence 1e-3.
    np.testing.assert_allclose(np.asarray(t1), np.asarray(t2), rtol=1e-3, atol=1e-3)
    for a, b_ in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-3, atol=1e-3)


def test_sparse_backward_a_million_ids_counts_overflow():
    rng = np.random.default_rng(2)
    b, hot, dim, vocab = 1 << 14, 64, 32, 200_000
    ids = _zipf_ids(rng, b * hot, vocab)
    seg = np.repeat(np.arange(b, dtype=np.int32), hot)
    cot = jnp.asarray(rng.normal(size=(b, dim)), jnp.float32)
    distinct = len(np.unique(ids[ids >= 0]))
    for cap in (distinct + 100, distinct // 2):
        got = jax.jit(functools.partial(ops.lookup_pool_backward, capacity=cap, combiner="sum"))(
            cot, jnp.asarray(ids), jnp.asarray(seg)
        )
        want = ops.lookup_pool_backward(
            cot,
            jnp.asarray(ids),
            jnp.asarray(seg),
            capacity=cap,
            combiner="sum",
            backend="reference",
        )
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        # A float32 sum of n terms in another order differs by up to ~sqrt(n) eps sum|terms|:
        # bound each element by its row's mass (the same backward of |cot|), so a hot row's
        # rounding passes and a missing term in an ordinary row does not.
        mass = ops.lookup_pool_backward(
            jnp.abs(cot),
            jnp.asarray(ids),
            jnp.asarray(seg),
            capacity=cap,
            combiner="sum",
            backend="reference",
        )[1]
        err = np.abs(np.asarray(got[1]) - np.asarray(want[1]))
        assert np.all(err <= 2e-5 * np.asarray(mass) + 1e-5), float(err.max())
        assert int(got[2]) == int(want[2]) == max(distinct - cap, 0)


def test_sparse_update_many_rows():
    rng = np.random.default_rng(3)
    vocab, dim, c = 200_000, 128, 100_000
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.bfloat16)
    rows = jnp.asarray(rng.choice(vocab, size=c, replace=False).astype(np.int32))
    grads = jnp.asarray(rng.normal(size=(c, dim)), jnp.float32)
    for opt in OPTIMIZERS:
        state = opt.init(table)
        t1, _ = ops.sparse_update(table, state, rows, grads, opt, assume_unique=True)
        t2, _ = ops.sparse_update(table, state, rows, grads, opt, backend="reference")
        np.testing.assert_allclose(
            np.asarray(t1, np.float32), np.asarray(t2, np.float32), rtol=1e-2, atol=1e-2
        )


@pytest.mark.parametrize("dim", [16, 64, 128, 13])
def test_sorted_pooling_large_batch(dim):
    """The sorted path at benchmark-like sizes: bf16 table, int64 ids, empty bags, ids >= V."""
    rng = np.random.default_rng(4)
    b, hot, vocab = 4096, 40, 100_000
    with x64(True):
        ids = rng.integers(-1, vocab + 100, size=(b, hot)).astype(np.int64)
        ids[::7] = -1  # empty bags
        seg = np.repeat(np.arange(b), hot).astype(np.int32)
        ids = ids.reshape(-1)
        table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.bfloat16)
        w = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
        for combiner in ("sum", "mean", "sqrtn"):
            got = ops.lookup_pool(
                table,
                jnp.asarray(ids),
                jnp.asarray(seg),
                b,
                jnp.asarray(w),
                combiner,
                indices_are_sorted=True,
                out_dtype=jnp.float32,
            )
            want = reference.lookup_pool(
                table.astype(jnp.float32),
                jnp.asarray(ids),
                jnp.asarray(seg),
                b,
                jnp.asarray(w),
                combiner,
            )
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_cuda_workspaces_are_checked():
    ids = jnp.array([0, 1], jnp.int32)
    call = _ffi._call(  # the workspace, then the output
        abi.Target.LOOKUP_POOL,
        (_ffi.result_type(ids, (1,), jnp.uint8), _ffi.result_type(ids, (2, 4), jnp.float32)),
    )
    with pytest.raises(Exception, match=r"lookup_pool: workspace must have at least \d+ bytes"):
        jax.block_until_ready(
            call(
                jnp.ones((5, 4)),
                ids,
                jnp.array([0, 1]),
                jnp.ones((2,)),
                combiner=np.int64(0),
                indices_are_sorted=np.int64(1),
            )
        )
    seg_call = _ffi._call(
        abi.Target.SEGMENT_SUM,
        (_ffi.result_type(ids, (3, 4), jnp.bfloat16), _ffi.result_type(ids, (1,), jnp.uint8)),
    )
    with pytest.raises(Exception, match=r"segment_sum: workspace must have at least 48 bytes"):
        jax.block_until_ready(seg_call(jnp.ones((2, 4), jnp.bfloat16), ids))


def test_distributed_step_on_the_gpu_matches_the_single_device_reference():
    """shard_map over the GPU(s): each device pools its ids against its table shard, then the
    sparse backward + update; against the reference on the full table on one device."""
    devices = jax.devices()
    g = len(devices)
    mesh = jax.make_mesh((g,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(5)
    v_local, d, b, h = 1000, 64, 256, 8
    table = rng.normal(size=(g * v_local, d)).astype(np.float32)
    ids = rng.integers(-1, v_local, size=(g, b * h)).astype(np.int32)
    ids[:, : 3 * h] = 7  # a hot row in every shard
    seg = np.tile(np.repeat(np.arange(b, dtype=np.int32), h), g)
    cot = rng.normal(size=(g * b, d)).astype(np.float32)
    shard = functools.partial(jax.device_put, device=NamedSharding(mesh, P("d")))
    args = [shard(jnp.asarray(x)) for x in (table, ids.reshape(-1), seg, cot)]
    opt = O.Adagrad(learning_rate=0.3)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"),) * 4, out_specs=(P("d"),) * 2)
    def step(t, i, s, c):
        out = ops.lookup_pool(t, i, s, b, None, "mean", indices_are_sorted=True)
        new_t, _, _ = ops.lookup_pool_backward_update(
            t, opt.init(t), c, i, s, optimizer=opt, combiner="mean"
        )
        return out, new_t

    out, new_t = step(*args)
    for k in range(g):  # the single-device reference, shard by shard
        t_k = jnp.asarray(table[k * v_local : (k + 1) * v_local])
        i_k, s_k = jnp.asarray(ids[k]), jnp.asarray(seg[k * b * h : (k + 1) * b * h])
        c_k = jnp.asarray(cot[k * b : (k + 1) * b])
        want_out = numpy_ref.lookup_pool(
            table[k * v_local : (k + 1) * v_local], ids[k], np.asarray(s_k), b, None, "mean"
        )
        np.testing.assert_allclose(
            np.asarray(out)[k * b : (k + 1) * b], want_out, rtol=1e-4, atol=1e-4
        )
        want_t, _, _ = ops.lookup_pool_backward_update(
            t_k,
            opt.init(t_k),
            c_k,
            i_k,
            s_k,
            optimizer=opt,
            combiner="mean",
            backend="reference",
        )
        np.testing.assert_allclose(
            np.asarray(new_t)[k * v_local : (k + 1) * v_local],
            np.asarray(want_t),
            rtol=1e-4,
            atol=1e-4,
        )


@pytest.mark.parametrize("opt", [O.SGD(learning_rate=0.1), O.RowWiseAdagrad(learning_rate=0.1)])
def test_hot_id_split_at_the_run_length_boundaries(opt):
    """Runs of 511..1025 ids around the split threshold (512, pieces of 256), D = 200 (two
    column chunks, the last one partial), both dedup kernels, against the reference."""
    rng = np.random.default_rng(6)
    lengths = {3: 511, 10: 512, 11: 513, 20: 768, 21: 1025, 40: 1}
    ids = np.concatenate([np.full(n, r, np.int32) for r, n in lengths.items()])
    ids = np.concatenate([ids, rng.integers(-1, 500, size=3000).astype(np.int32)])
    rng.shuffle(ids)
    n, dim, vocab = ids.shape[0], 200, 500
    cot = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, size=n), jnp.float32)
    seg = jnp.arange(n, dtype=jnp.int32)
    got = ops.lookup_pool_backward(cot, jnp.asarray(ids), None, w, capacity=600, combiner="none")
    want = ops.lookup_pool_backward(
        cot, jnp.asarray(ids), None, w, capacity=600, combiner="none", backend="reference"
    )
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-3)
    table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32)
    kw = dict(optimizer=opt, combiner="none")
    t1, s1, _ = ops.lookup_pool_backward_update(
        table, opt.init(table), cot, jnp.asarray(ids), seg, w, **kw
    )
    t2, s2, _ = ops.lookup_pool_backward_update(
        table, opt.init(table), cot, jnp.asarray(ids), seg, w, backend="reference", **kw
    )
    np.testing.assert_allclose(np.asarray(t1), np.asarray(t2), rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
