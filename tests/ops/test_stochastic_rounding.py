"""Stochastic rounding of bfloat16 tables: small updates survive in expectation (rounded to
nearest, 20 SGD steps of 1e-3 leave 1.0 unchanged).

Near 1.0 the bfloat16 step is 2^-8 below 1 and 2^-7 above, so an SGD update of 1e-3 is
rounded away to nearest, while a stochastic rounding keeps it in expectation: the statistical
bounds below are several standard deviations of the mean over the table's elements, each
element moving by at most one step per update. The kernels and the `jnp` reference hash the
same (seed, row, column) bits, so they agree bit for bit; float32 tables are untouched.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embark_jax import ops
from embark_jax.core.options import DPGradients, RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.batch import Batch
from embark_jax.data.sparse import SparseFeatures
from embark_jax.ops import optimizers as O
from embark_jax.ops import reference
from embark_jax.sharding.collection import EmbeddingCollection, apply_gradients_fn
from embark_jax.sharding.lowering import lower
from embark_jax.training import state as train_state
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import StepRunner

BF16 = jnp.bfloat16
OPTIMIZERS = [
    O.SGD(learning_rate=0.1),
    O.Adagrad(learning_rate=0.1, eps=1e-3),
    O.RowWiseAdagrad(learning_rate=0.1, eps=1e-3),
    O.Adam(learning_rate=0.1, b1=0.8, b2=0.95, eps=1e-3),
]


def bits(x):
    return np.asarray(x).view(np.uint16 if x.dtype == BF16 else np.uint32)


@functools.partial(jax.jit, static_argnames=("fused", "backend", "stochastic"))
def sgd_steps(table, seeds, *, fused, backend, stochastic):
    """len(seeds) SGD steps of lr * grad = 1e-3 on every row (seed i at step i)."""
    opt = O.SGD(learning_rate=1e-3)
    v, d = table.shape
    rows = jnp.arange(v, dtype=jnp.int32)
    ones = jnp.ones((v, d), jnp.float32)

    def step(t, seed):
        seed = seed if stochastic else None
        if fused:  # the fused backward + update, one id per output row
            kw = dict(optimizer=opt, combiner="none", seed=seed, backend=backend)
            t, _, _ = ops.lookup_pool_backward_update(t, (), ones, rows, None, **kw)
        else:
            kw = dict(assume_unique=True, seed=seed, backend=backend)
            t, _ = ops.sparse_update(t, (), rows, ones, opt, **kw)
        return t, None

    return jax.lax.scan(step, table, seeds)[0]


@pytest.mark.parametrize("fused", [False, True], ids=["sparse_update", "fused"])
@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_small_sgd_updates_survive_in_expectation(fused, backend):
    """20 SGD steps of 1e-3 from 1.0 end near 0.98 on average (per-element
    standard deviation < 0.01, so the mean over 4096 elements is within 1e-3 of it); round to
    nearest leaves every element at exactly 1.0."""
    table = jnp.ones((512, 8), BF16)
    seeds = jnp.arange(20, dtype=jnp.uint32) * 7919
    run = functools.partial(sgd_steps, table, seeds, fused=fused, backend=backend)
    got = np.asarray(run(stochastic=True), np.float32)
    assert abs(got.mean() - 0.98) < 1e-3, got.mean()
    assert got.min() >= 0.98 - 8 * 2**-8 and got.max() <= 1.0  # within a few steps of it
    assert len(np.unique(got)) > 2  # individual elements took different paths
    nearest = np.asarray(run(stochastic=False), np.float32)
    np.testing.assert_array_equal(nearest, np.ones_like(nearest))


IDS = jnp.array([4, 7, -1, 4, 29, 31, 0, 17, 17, 3], jnp.int32)  # repeats, padding, >= V
SEG = jnp.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 4], jnp.int32)


def grads_of_step(step, d=8):
    rng = np.random.default_rng(step)
    g = jnp.asarray(rng.normal(size=(IDS.shape[0], d)), jnp.float32)
    return g, jnp.asarray(rng.normal(size=(5, d)), jnp.float32)


def _update(opt, table, state, g, cot, seed, *, fused, backend):
    """One update of `opt`: `sparse_update` of IDS with `g`, or the fused backward +
    update of a `mean` lookup of IDS in bags SEG with output gradients `cot`."""
    if fused:
        kw = dict(optimizer=opt, combiner="mean", seed=seed, backend=backend)
        table, state, _ = ops.lookup_pool_backward_update(table, state, cot, IDS, SEG, **kw)
        return table, state
    return ops.sparse_update(table, state, IDS, g, opt, seed=seed, backend=backend)


@pytest.mark.parametrize("fused", [False, True], ids=["sparse_update", "fused"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_kernel_matches_reference_bit_for_bit(opt, fused):
    """Three steps with three seeds: the CPU kernel's bf16 table equals the reference's bit
    for bit, slots to float32 rounding; and the rounding was not to nearest."""
    table = jnp.asarray(np.random.default_rng(0).normal(size=(40, 8)), BF16)
    results = {}
    for backend in ("ffi", "reference", "nearest"):
        be = "reference" if backend == "nearest" else backend
        upd = jax.jit(functools.partial(_update, opt, fused=fused, backend=be))
        t, s = table, opt.init(table)
        for step in range(3):
            seed = None if backend == "nearest" else jnp.uint32(1_000_003 * step + 11)
            t, s = upd(t, s, *grads_of_step(step), seed)
        results[backend] = (t, s)
    (t_ffi, s_ffi), (t_ref, s_ref) = results["ffi"], results["reference"]
    if jax.default_backend() == "gpu":  # XLA and nvcc may contract a * b + c differently:
        # a float32 result 1 ulp apart lands on the other side of a threshold w.p. ~2^-16
        diff = np.abs(bits(t_ffi).astype(np.int32) - bits(t_ref).astype(np.int32))
        assert diff.max() <= 1 and (diff > 0).sum() <= 2, diff
    else:
        np.testing.assert_array_equal(bits(t_ffi), bits(t_ref))
    for a, b in zip(jax.tree.leaves(s_ffi), jax.tree.leaves(s_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert (bits(t_ffi) != bits(results["nearest"][0])).any()
    touched = np.any(bits(t_ffi) != bits(table), axis=1)
    assert touched.sum() >= 5 and not touched.all()  # untouched rows stay bit-identical


def test_rounding_is_unbiased_and_lands_on_a_neighbour():
    """E[round(x)] = x over many independent bit draws (4096 rows), for values at several
    fractions of a bf16 step, both signs and a tiny magnitude; each result is one of the two
    bf16 neighbours of x."""
    n = 4096
    fractions = np.array([0.01, 0.25, 0.5, 0.9], np.float64)
    base = np.array([1.0, -1.5, 3e-30], np.float64)
    vals = []
    for b in base:
        step = 2.0 ** (np.floor(np.log2(abs(b))) - 7)
        vals += [b + np.sign(b) * f * step for f in fractions]
    x = np.asarray(vals, np.float32)
    rounded = reference.stochastic_round_bf16(
        jnp.broadcast_to(x, (n, x.size)), jnp.uint32(12345), jnp.arange(n, dtype=jnp.int32)
    )
    got = np.asarray(rounded, np.float64)
    down = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.uint32) >> 16)
    lo = np.asarray(jax.lax.bitcast_convert_type(down.astype(np.uint16), BF16), np.float64)
    hi = np.asarray(jax.lax.bitcast_convert_type((down + 1).astype(np.uint16), BF16), np.float64)
    assert np.all((got == lo) | (got == hi))
    gap = np.abs(hi - lo)
    p = np.abs(x.astype(np.float64) - lo) / gap
    sd = gap * np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(got.mean(axis=0) - x) < 5 * sd + 1e-3 * gap), (got.mean(axis=0), x)
    # special values: exact bf16 values, infinities and NaN are kept
    special = jnp.array([[1.0, -2.0, np.inf, -np.inf, np.nan, 0.0]], jnp.float32)
    out = np.asarray(
        reference.stochastic_round_bf16(special, jnp.uint32(7), jnp.zeros((1,), jnp.int32)),
        np.float32,
    )
    np.testing.assert_array_equal(out[0, :4], [1.0, -2.0, np.inf, -np.inf])
    assert np.isnan(out[0, 4]) and out[0, 5] == 0.0


def test_seeds_decide_the_rounding():
    """Same seed: the same table bit for bit (also with the rows in another order, which
    moves them between worker threads); another seed: another rounding."""
    table = jnp.ones((300, 8), BF16)
    opt = O.SGD(learning_rate=1e-3)
    rows = jnp.arange(300, dtype=jnp.int32)
    g = jnp.ones((300, 8), jnp.float32)
    perm = np.random.default_rng(0).permutation(300)

    @jax.jit
    def upd(rows, seed):
        return ops.sparse_update(table, (), rows, g, opt, assume_unique=True, seed=seed)[0]

    a = upd(rows, jnp.uint32(1))
    np.testing.assert_array_equal(bits(a), _np_stochastic_bf16(1.0 - 1e-3, 1, 300, 8))
    np.testing.assert_array_equal(bits(upd(rows[perm], jnp.uint32(1))), bits(a))
    c = upd(rows, jnp.uint32(2))
    assert (bits(a) != bits(c)).mean() > 0.2  # each element rounds down w.p. about 1/4
    # per-step seeds: a hash of the key and the step, as written out below in numpy
    key = jax.random.key_data(jax.random.key(0))
    seeds = {int(O.rounding_seed(key, s)) for s in range(100)}
    assert len(seeds) == 100
    for k in (key, jax.random.key_data(jax.random.key(1))):
        for step in (0, 5, 2**31 - 1):
            assert int(O.rounding_seed(k, step)) == _np_rounding_seed(np.asarray(k), step)


def _np_mix32(x: int) -> int:
    """Wellons' lowbias32 on a Python int (the ABI's Mix32), written out independently."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _np_rounding_seed(key_words, step: int) -> int:
    h = _np_mix32(int(step) ^ 0x85EBCA6B)
    for word in np.ravel(key_words).astype(np.uint32):
        h = _np_mix32(h ^ int(word))
    return h


def _np_stochastic_bf16(value: float, seed: int, rows: int, dim: int) -> np.ndarray:
    """The bf16 bits of float32 `value` stored at every (row, column) of a [rows, dim] table
    under `seed`: RowKey/ElementBits/StochasticBf16 of embark_abi.h, in plain Python."""
    f32 = int(np.float32(value).view(np.uint32))
    out = np.zeros((rows, dim), np.uint16)
    for r in range(rows):
        h = _np_mix32(seed ^ 0x9E3779B9)
        h = _np_mix32(_np_mix32(h ^ r) ^ 0)
        for j in range(dim):
            random = _np_mix32(h ^ j)
            out[r, j] = ((f32 + (random >> 16)) >> 16) & 0xFFFF
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["sparse_update", "fused"])
def test_float32_tables_ignore_the_seed(fused):
    table = jnp.asarray(np.random.default_rng(1).normal(size=(40, 8)), jnp.float32)
    for opt in OPTIMIZERS:
        upd = jax.jit(functools.partial(_update, opt, fused=fused, backend="ffi"))
        with_seed = upd(table, opt.init(table), *grads_of_step(0), jnp.uint32(99))
        without = upd(table, opt.init(table), *grads_of_step(0), None)
        for a, b in zip(jax.tree.leaves(with_seed), jax.tree.leaves(without), strict=True):
            np.testing.assert_array_equal(
                np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8)
            )


# --- through the collection and the train step (8 fake devices, every cluster) -------------

B, D, V = 16, 16, 16
PLAN = Plan(
    topology=Topology(num_nodes=1, devices_per_node=8),
    batch_size=B,
    tables=(
        TablePlan(
            name="dp", cluster="dp", row_shards=1, column_shards=1, devices=(tuple(range(8)),)
        ),
        TablePlan(name="rb", cluster="rb", row_shards=2, column_shards=2, devices=((0, 1), (2, 3))),
        TablePlan(name="ub", cluster="ub", row_shards=2, column_shards=1, devices=((4, 5),)),
    ),
)


def ones_config(stochastic_rounding):
    init = lambda key, shape, dtype: jnp.ones(shape, dtype)  # noqa: E731
    tables = [
        TableConfig(
            name=n,
            vocab_size=V,
            dim=D,
            dtype=BF16,
            initializer=init,
            stochastic_rounding=stochastic_rounding,
        )
        for n in ("dp", "rb", "ub")
    ]
    features = [FeatureConfig(name=f"f_{n}", table=n) for n in ("dp", "rb", "ub")]
    return EmbeddingConfig.create(tables, features)


def test_table_option_and_lowering():
    """Default on for bfloat16, meaningless (off) for float32, a bool; bfloat16 tables that
    round to nearest get groups of their own (the choice is per kernel call)."""
    kw = dict(name="t", vocab_size=4, dim=2)
    assert TableConfig(**kw, dtype=BF16).rounds_stochastically
    assert not TableConfig(**kw, dtype=BF16, stochastic_rounding=False).rounds_stochastically
    assert not TableConfig(**kw).rounds_stochastically  # float32: stored exactly
    with pytest.raises(ValueError, match="stochastic_rounding must be True or False"):
        TableConfig(**kw, dtype=BF16, stochastic_rounding="no")
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=8),
        batch_size=B,
        tables=tuple(
            TablePlan(name=n, cluster="rb", row_shards=1, column_shards=1, devices=((0,),))
            for n in ("a", "b", "c")
        ),
    )
    tables = [
        TableConfig(name="a", vocab_size=V, dim=D, dtype=BF16),
        TableConfig(name="b", vocab_size=V, dim=D, dtype=BF16, stochastic_rounding=False),
        TableConfig(name="c", vocab_size=V, dim=D),
    ]
    config = EmbeddingConfig.create(tables, [FeatureConfig(name=n, table=n) for n in "abc"])
    groups = {g.name: (g.tables, g.stochastic_rounding) for g in lower(plan, config).groups}
    assert groups == {
        f"rb_w{D}_bfloat16": (("a",), True),
        f"rb_w{D}_bfloat16_nearest": (("b",), False),
        f"rb_w{D}_float32": (("c",), False),
    }


needs_8_devices = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")


@needs_8_devices
@pytest.mark.parametrize("dp_gradients", [DPGradients.DENSE, DPGradients.SPARSE])
def test_collection_keeps_small_updates_of_bf16_tables(dp_gradients):
    """20 `apply_gradients` of SGD(1e-3) with output gradient 1 on every row of every
    cluster's table (one id per row): with the default stochastic rounding the tables end
    near 0.98 on average and the data-parallel replicas stay bit-identical; rounding to
    nearest (`stochastic_rounding=False`) leaves them at 1.0."""
    ids = {f"f_{n}": np.arange(B)[:, None] % V for n in ("dp", "rb", "ub")}
    means = {}
    for sr in (True, False):
        config = ones_config(sr)
        coll = EmbeddingCollection(
            config,
            PLAN,
            PLAN.make_mesh(),
            rngs=nnx.Rngs(0),
            optimizer=O.SGD(learning_rate=1e-3),
            options=RuntimeOptions(dp_gradients=dp_gradients),
        )
        assert all(g.stochastic_rounding == sr for g in coll.lowered.groups)
        batch = coll.shard_batch(SparseFeatures.from_dense(ids, config=config))
        for _ in range(20):
            res = coll.lookup(batch)
            coll.apply_gradients(res, {k: jnp.ones_like(v) for k, v in res.outputs.items()}, batch)
        means[sr] = {
            k: float(np.asarray(t, np.float32).mean()) for k, t in coll.full_tables().items()
        }
        dp = next(g.name for g in coll.lowered.groups if g.cluster.value == "dp")
        replicas = bits(coll.buffer_values()[dp])
        assert (replicas == replicas[:1]).all()  # every device holds the same replica
    for name in ("dp", "rb", "ub"):
        # 256 elements, per-element sd < 0.01: the mean is within 3e-3 of 0.98 (5 sd)
        assert abs(means[True][name] - 0.98) < 3e-3, (name, means[True])
        assert means[False][name] == 1.0, (name, means[False])


@needs_8_devices
def test_train_step_seeds_each_step():
    """The train step rounds with `rounding_seed(state.rng, state.step)`: reproducible from
    the same state; an update of 1e-3 on weights 1.0 moves a fraction of the elements by one
    bf16 step where rounding to nearest moves none; the functional API refuses to round
    stochastically without a seed."""
    dense = DenseConfig(kind="dlrm", bottom=(8, D), top=(8, 1))
    # Adagrad's first step is lr * sign(g) = 1e-3 whatever the gradient's magnitude
    kw = dict(dense=dense, sparse_optimizer=O.Adagrad(learning_rate=1e-3), num_dense=4)
    ids = {f"f_{n}": np.arange(B)[:, None] % V for n in ("dp", "rb", "ub")}
    tables = {}
    for sr in (True, False):
        config = ones_config(sr)
        setup, state = train_state.create(config, PLAN, **kw)
        batch = Batch(
            dense=np.zeros((B, 4), np.float32),
            labels=np.ones((B,), np.float32),
            sparse=SparseFeatures.from_dense(ids, config=config),
        )
        runner = StepRunner(setup)  # donates: each step gets its own copy of the state
        s1, _ = runner.step(jax.tree.map(jnp.copy, state), batch)
        s2, _ = runner.step(jax.tree.map(jnp.copy, state), batch)
        for a, b in zip(jax.tree.leaves(s1.tables), jax.tree.leaves(s2.tables), strict=True):
            np.testing.assert_array_equal(bits(a), bits(b))  # same state, same seed
        tables[sr] = train_state.full_tables(setup, s1)
        if sr:
            lw = setup.lowered
            with pytest.raises(ValueError, match="need a new seed every step"):
                apply_gradients_fn(
                    lw,
                    setup.mesh,
                    setup.options,
                    state.tables,
                    state.slots,
                    None,
                    None,
                    setup.optimizers,
                    batch.sparse,
                )
    for n in ("dp", "rb", "ub"):
        assert (np.asarray(tables[False][n], np.float32) == 1.0).all(), n  # lost to nearest
        moved = np.asarray(tables[True][n], np.float32) != 1.0
        assert 0.05 < moved.mean() < 0.5, (n, moved.mean())  # kept with p ~ 1e-3 / step
