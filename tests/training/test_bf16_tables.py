"""bfloat16 tables (`TableConfig(dtype=bfloat16)`) end to end:
through the collection (lookup and the sparse update against a float64 numpy reference
at bf16 precision), training (`create` + `StepRunner`) and the
checkpoint round trip (bit-exact).

bf16 precision, stated once: bf16 keeps 8 significant bits, so a rounding moves a value by
at most 2^-9 of its magnitude. A pooled output may be rounded once per partial sum
(per row shard on the owner, once more at the requester), so it is checked within
2^-7 x (sum of |w_i x row_i| over its ids); an updated row value within 2^-7 x |value|
(one bf16 step: the tables round their updates stochastically, `TableConfig`) plus
2^-7 x lr x (sum of |per-id gradients| of that row), since gradients travel in the table
dtype too. Well below what a broken path moves (a dropped id, zeroed columns)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.sharding.collection import EmbeddingCollection
from embark_jax.training import checkpoint as ckpt
from embark_jax.training import state as train_state
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import StepRunner

BF16 = jnp.bfloat16
B, D = 16, 8
CFG = EmbeddingConfig.create(
    [
        TableConfig(name="dp", vocab_size=20, dim=D, dtype=BF16),
        TableConfig(name="rb", vocab_size=64, dim=D, dtype=BF16),
        TableConfig(name="ub", vocab_size=40, dim=D, dtype=BF16),
    ],
    [
        FeatureConfig(name="f_dp", table="dp", max_hotness=2),
        FeatureConfig(name="f_rb", table="rb", max_hotness=4, combiner="mean", weighted=True),
        FeatureConfig(name="f_ub", table="ub", max_hotness=3, combiner="sqrtn"),
        FeatureConfig(name="f_seq", table="ub", max_hotness=2, combiner="none"),
    ],
)
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
LR = 0.5
OPTS = {
    "dp": O.SGD(learning_rate=LR),
    "rb": O.Adagrad(learning_rate=LR, initial_accumulator=1.0),
    "ub": O.SGD(learning_rate=LR),
}


def make_batch(seed):
    rng = np.random.default_rng(seed)
    ids, weights = {}, {}
    for f in CFG.features:
        x = rng.integers(0, CFG.table_of(f.name).vocab_size, size=(B, f.max_hotness))
        x[rng.random(x.shape) < 0.25] = -1
        x[3] = -1  # an empty bag
        ids[f.name] = x
        if f.weighted:
            weights[f.name] = rng.uniform(0.5, 2.0, size=x.shape)
    return SparseFeatures.from_dense(ids, weights, config=CFG)


def per_id_terms(batch):
    """Per feature: `[(sample, slot, id, scale)]` for every valid id, with the id's factor
    in its output (w / denominator for mean and sqrtn), written out in numpy."""
    out = {}
    for f in CFG.features:
        ids, n = np.asarray(batch.ids[f.name]), np.asarray(batch.lengths[f.name])
        w = np.asarray(batch.weights[f.name], np.float64) if f.weighted else np.ones(ids.shape)
        terms = []
        for i in range(ids.shape[0]):
            ws = w[i, : n[i]]
            denom = {"sum": 1.0, "none": 1.0, "mean": ws.sum(), "sqrtn": np.sqrt((ws**2).sum())}
            for j in range(n[i]):
                terms.append((i, j, int(ids[i, j]), w[i, j] / denom[f.combiner.value]))
        out[f.name] = terms
    return out


def numpy_lookup(tables, batch):
    """(float64 outputs, sum of |terms| per output element) of every feature."""
    out, mag = {}, {}
    for f in CFG.features:
        t = np.asarray(tables[f.table], np.float64)
        shape = (B, f.max_hotness, D) if f.combiner.value == "none" else (B, D)
        y, m = np.zeros(shape), np.zeros(shape)
        for i, j, x, s in per_id_terms(batch)[f.name]:
            at = (i, j) if f.combiner.value == "none" else i
            y[at] += s * t[x]
            m[at] += np.abs(s * t[x])
        out[f.name], mag[f.name] = y, m
    return out, mag


def numpy_update(tables, batch, grads):
    """(float64 tables after one step of OPTS, sum of |per-id gradients| per row)."""
    new, mag = {}, {}
    terms = per_id_terms(batch)
    for tc in CFG.tables:
        g = np.zeros((tc.vocab_size, D))
        m = np.zeros((tc.vocab_size, D))
        for f in CFG.features:
            if f.table != tc.name:
                continue
            go = np.asarray(grads[f.name], np.float64)
            for i, j, x, s in terms[f.name]:
                gi = s * (go[i, j] if f.combiner.value == "none" else go[i])
                g[x] += gi
                m[x] += np.abs(gi)
        w = np.asarray(tables[tc.name], np.float64)
        touched = np.any(m > 0, axis=1)
        if isinstance(OPTS[tc.name], O.Adagrad):
            step = LR * g / (np.sqrt(1.0 + g * g) + OPTS[tc.name].eps)
        else:
            step = LR * g
        new[tc.name] = np.where(touched[:, None], w - step, w)
        mag[tc.name] = m
    return new, mag


def assert_bf16_close(got, want, magnitude, what):
    got = np.asarray(np.asarray(got, np.float32), np.float64)
    bound = 2.0**-7 * magnitude + 1e-7
    bad = np.abs(got - want) > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.size} values beyond bf16 precision; first at "
        f"{np.argwhere(bad)[0].tolist()}: got {got[bad][0]}, want {want[bad][0]}"
    )


@pytest.fixture(scope="module")
def coll():
    return EmbeddingCollection(CFG, PLAN, PLAN.make_mesh(), rngs=nnx.Rngs(0), optimizer=OPTS)


def test_collection_lookup_and_update_at_bf16_precision(coll):
    assert all(b.dtype == BF16 for b in coll.buffer_values().values())
    batch = make_batch(1)
    before = coll.full_tables()
    assert all(t.dtype == BF16 for t in before.values())
    res = coll.lookup(coll.shard_batch(batch))
    assert all(int(v) == 0 for v in res.overflow.values())
    want, mag = numpy_lookup(before, batch)
    for name in want:
        assert_bf16_close(res.outputs[name], want[name], mag[name], f"lookup {name}")
        assert np.abs(want[name]).max() > 0.1  # not vacuous

    rng = np.random.default_rng(2)
    grads = {k: jnp.asarray(rng.normal(size=v.shape), v.dtype) for k, v in res.outputs.items()}
    coll.apply_gradients(res, grads, coll.shard_batch(batch))
    after = coll.full_tables()
    want_t, gmag = numpy_update(before, batch, grads)
    for name, w in want_t.items():
        assert after[name].dtype == BF16, name
        magnitude = np.abs(w) + LR * gmag[name]  # 2^-7 |w| + 2^-7 lr sum|g|
        assert_bf16_close(after[name], w, magnitude, f"updated table {name}")
        touched = np.any(gmag[name] > 0, axis=1)
        assert touched.any() and not touched.all(), name
        # untouched rows are bit-identical, touched ones moved
        np.testing.assert_array_equal(
            after[name][~touched].view(np.uint16), before[name][~touched].view(np.uint16)
        )
        moved = np.any(after[name][touched] != before[name][touched], axis=1)
        assert moved.all(), name


DENSE = DenseConfig(kind="dlrm", bottom=(8, D), top=(8, 1))


@pytest.fixture(scope="module")
def trained():
    """A runner and its state after 3 steps with bf16 tables (Adam: two slots and a count)."""
    setup, state = train_state.create(
        CFG,
        PLAN,
        dense=DENSE,
        sparse_optimizer=O.Adam(learning_rate=0.05),
        dense_optimizer=optax.sgd(0.1),
        num_dense=4,
    )
    runner = StepRunner(setup)
    ds = SyntheticDataset(CFG, batch_size=B, num_dense=4, seed=5)
    tables0 = train_state.full_tables(setup, state)
    losses = []
    for i in range(3):
        state, r = runner.step(state, ds.batch(i))
        losses.append(float(r.loss))
    return {"runner": runner, "state": state, "ds": ds, "losses": losses, "tables0": tables0}


def test_training_with_bf16_tables(trained):
    runner, state = trained["runner"], trained["state"]
    assert all(np.isfinite(trained["losses"])) and int(state.step) == 3
    assert runner.num_compilations() == 1
    for name, buf in state.tables.items():
        assert buf.dtype == BF16, name  # the step keeps the table dtype
        for slot in jax.tree.leaves(state.slots[name]):
            assert slot.dtype in (jnp.float32, jnp.int32), name  # slots stay float32
    hlo = runner.compiled_step(state, trained["ds"].batch(0)).as_text()
    assert "bf16" in hlo
    tables = train_state.full_tables(runner.setup, state)
    for name, t in tables.items():
        assert t.dtype == BF16 and np.isfinite(t.astype(np.float32)).all()
        assert not np.array_equal(t, trained["tables0"][name]), name  # training moved them


def test_checkpoint_round_trip_of_bf16_tables_is_bit_exact(trained, tmp_path):
    runner, state = trained["runner"], trained["state"]
    setup = runner.setup
    ckpt.save(str(tmp_path), setup, state)
    other_setup, _ = train_state.create(
        CFG,
        PLAN,
        dense=DENSE,
        sparse_optimizer=O.Adam(learning_rate=0.05),
        dense_optimizer=optax.sgd(0.1),
        num_dense=4,
        seed=9,  # other initial values everywhere
    )
    restored, meta = ckpt.restore(str(tmp_path), other_setup)
    assert int(restored.step) == 3 == meta["step"]
    lw = setup.lowered
    for tp in lw.plan.tables:
        a = ckpt.table_arrays(lw, tp.name, state.tables, state.slots)
        b = ckpt.table_arrays(other_setup.lowered, tp.name, restored.tables, restored.slots)
        assert np.asarray(a["table"]).dtype == BF16 == np.asarray(b["table"]).dtype
        np.testing.assert_array_equal(  # bit-exact: compare the bf16 bit patterns
            np.asarray(a["table"]).view(np.uint16), np.asarray(b["table"]).view(np.uint16)
        )
        assert sorted(a["slots"]) == sorted(b["slots"])
        for k in a["slots"]:
            np.testing.assert_array_equal(np.asarray(a["slots"][k]), np.asarray(b["slots"][k]))

    # the dense side and the stacked buffers too (slots compared in logical form above:
    # a device holding no shard of a table keeps a meaningless Adam count)
    def rest(s):
        return jax.tree.leaves((s.step, s.dense_params, s.dense_opt, s.rng, s.tables))

    for x, y in zip(rest(state), rest(restored), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # and training continues identically from both
    batch = trained["ds"].batch(3)
    s1, r1 = runner.step(state, batch)
    s2, r2 = runner.step(restored, batch)
    assert r1.loss == r2.loss
    for x, y in zip(jax.tree.leaves(s1.tables), jax.tree.leaves(s2.tables), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
