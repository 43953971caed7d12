"""The train step costs what its batch costs: updated in place (no whole-table operation in
the compiled step, the tables aliased, temporaries small), transactional on the device (a
refused step leaves every buffer bit-identical, with donation on), and driven by a runner
that never waits for the step it just enqueued and changes learning rates without
recompiling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.batch import Batch
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.sharding.checks import CapacityOverflowError
from embark_jax.training import state as train_state
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import NonFiniteLossError, StepRunner
from embark_jax.training.step_cost import memory_summary, whole_table_ops

DENSE = DenseConfig(kind="dcnv2", bottom=(8, 8), top=(8, 1), cross_layers=1, cross_rank=4)
needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")


def one_table(vocab, cluster, *, dim=64, hot=8, batch=4096, devices=1, dtype="float32"):
    config = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=vocab, dim=dim, dtype=dtype)],
        [FeatureConfig(name="f", table="t", max_hotness=hot)],
    )
    every = (tuple(range(devices)),)
    r = 1 if cluster == "dp" else devices
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=devices),
        batch_size=batch,
        tables=(
            TablePlan(name="t", cluster=cluster, row_shards=r, column_shards=1, devices=every),
        ),
    )
    return config, plan


@pytest.mark.parametrize("cluster", ["rb", "ub", "dp"])
def test_the_default_step_touches_no_whole_table_on_a_million_rows(cluster):
    """One device, 1M x 64, row-wise Adagrad, batch 4096 x 8: the runner's compiled step has
    no operation that reads, copies or writes the table or its accumulator; both are
    aliased, and the temporaries stay under 10% of their bytes."""
    config, plan = one_table(1_000_000, cluster)
    setup, state = train_state.create(
        config, plan, dense=DENSE, sparse_optimizer=O.RowWiseAdagrad(learning_rate=0.01)
    )
    runner = StepRunner(setup)
    batch = SyntheticDataset(config, batch_size=4096, seed=0).batch(0)
    compiled = runner.compiled_step(state, batch)
    assert whole_table_ops(compiled, state, 1) == []
    mem = memory_summary(compiled, state)
    assert mem["alias_bytes"] >= mem["table_and_slot_bytes"]
    assert mem["temp_fraction"] < 0.10, mem


def test_an_undonated_step_is_seen_copying_the_table():
    """The check can fail: the same step without donation copies the table and slot."""
    from embark_jax.training.step import compile_train_step

    config, plan = one_table(50_000, "rb", batch=256)
    setup, state = train_state.create(
        config, plan, dense=DENSE, sparse_optimizer=O.RowWiseAdagrad(learning_rate=0.01)
    )
    batch = jax.device_put(
        SyntheticDataset(config, batch_size=256, seed=0).batch(0), setup.table_sharding
    )
    kept = compile_train_step(setup, donate=False).lower(state, batch).compile()
    copied = {b for f in whole_table_ops(kept, state, 1) if f["copy"] for b in f["buffers"]}
    assert len(copied) == 2, copied  # the table and its accumulator
    donated = compile_train_step(setup, donate=True).lower(state, batch).compile()
    assert whole_table_ops(donated, state, 1) == []


# --- 8 devices: every cluster kind, bf16 with stochastic rounding ------------------------

CFG8 = EmbeddingConfig.create(
    [
        TableConfig(name="dp", vocab_size=48, dim=8),
        TableConfig(name="rb", vocab_size=4096, dim=8),
        TableConfig(name="ub", vocab_size=2048, dim=8),
        TableConfig(name="bf", vocab_size=1024, dim=8, dtype="bfloat16"),
    ],
    [
        FeatureConfig(name="f_dp", table="dp", max_hotness=2),
        FeatureConfig(name="f_rb", table="rb", max_hotness=4, combiner="mean"),
        FeatureConfig(name="f_ub", table="ub", max_hotness=2),
        FeatureConfig(name="f_bf", table="bf", max_hotness=3),
    ],
)
EVERY = (tuple(range(8)),)
PLAN8 = Plan(
    topology=Topology(num_nodes=2, devices_per_node=4),
    batch_size=64,
    tables=(
        TablePlan(name="dp", cluster="dp", row_shards=1, column_shards=1, devices=EVERY),
        TablePlan(name="rb", cluster="rb", row_shards=8, column_shards=1, devices=EVERY),
        TablePlan(name="ub", cluster="ub", row_shards=8, column_shards=1, devices=EVERY),
        TablePlan(
            name="bf",
            cluster="rb",
            row_shards=4,
            column_shards=2,
            devices=((0, 1, 2, 3), (4, 5, 6, 7)),
        ),
    ),
)


def make8(opt, *, dense_opt=None, **options):
    setup, state = train_state.create(
        CFG8,
        PLAN8,
        dense=DENSE,
        num_dense=4,
        sparse_optimizer=opt,
        dense_optimizer=dense_opt,
        options=RuntimeOptions(**options),
    )
    return StepRunner(setup), state, SyntheticDataset(CFG8, batch_size=64, num_dense=4, seed=2)


def host_bits(state):
    """Every leaf of the state as host bytes (tables, slots, dense parameters, optax state,
    step), for bit-for-bit comparison; not the staging memory, scratch that every step writes
    and none reads (`TrainState.staging`)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(state.replace(staging={}))]


@needs_8
def test_the_8_device_step_touches_no_whole_table():
    """Every cluster kind (DP exchanging sparse gradients: the dense exchange is, by design,
    an all-reduce of a tiny table's whole gradient)."""
    runner, state, ds = make8(O.Adam(learning_rate=0.01), dp_gradients="sparse")
    compiled = runner.compiled_step(state, ds.batch(0))
    found = whole_table_ops(compiled, state, 8)
    assert found == [], [f["name"] for f in found]


def nan_from(step):
    """A learning rate that becomes NaN from the optimizer's step `step` on."""
    return lambda count: jnp.where(count >= step, jnp.nan, 0.05)


@needs_8
@pytest.mark.parametrize("bad", ["nan-sparse-lr", "nan-dense-lr", "inf-feature", "overflow-error"])
def test_a_refused_step_leaves_every_buffer_bit_identical(bad):
    """Donation on, 8 devices, DP, RB, UB and a bfloat16 RB table rounding stochastically:
    a step refused for a NaN sparse or dense learning rate, an inf dense feature or (under
    `overflow="error"`) an overflow writes nothing; the error names the step, one step late;
    the run then goes on from the returned state."""
    opt = O.Adagrad(learning_rate=nan_from(1) if bad == "nan-sparse-lr" else 0.05)
    dense_opt = optax.sgd(nan_from(1)) if bad == "nan-dense-lr" else None
    options = {"overflow": "error", "capacity_factor": 0.3} if bad == "overflow-error" else {}
    runner, state, ds = make8(opt, dense_opt=dense_opt, **options)
    good = ds.batch(0)
    if bad != "overflow-error":
        state, _ = runner.step(state, good)
        runner.sync()
    before = host_bits(state)
    batch = ds.batch(1)
    if bad == "inf-feature":
        runner.validate_inputs = False  # the device's verdict, not the host's check
        dense = np.array(batch.dense)
        dense[3, 1] = np.inf
        batch = Batch(batch.sparse, dense, batch.labels)
    state, _ = runner.step(state, batch)
    kind = CapacityOverflowError if bad == "overflow-error" else NonFiniteLossError
    want_step = 1 if bad == "overflow-error" else 2
    with pytest.raises(kind, match=f"at step {want_step} ") as e:
        runner.sync()
    assert e.value.step == want_step
    assert host_bits(state) == before  # nothing of the refused step was written
    assert all(not x.is_deleted() for x in jax.tree.leaves(state))


@needs_8
def test_a_refusal_raises_one_step_late_and_halts_the_steps_behind_it():
    """The runner reads step t's flags after enqueueing step t+1: the error comes from the
    next `step` call, names step t, and its `state` is the last committed one (the device
    refused step t+1 too, since it ran behind a refusal); afterwards training goes on."""
    runner, state, ds = make8(O.SGD(learning_rate=0.05), dense_opt=optax.sgd(nan_from(1)))
    state, _ = runner.step(state, ds.batch(0))
    runner.sync()
    committed = host_bits(state)
    state, _ = runner.step(state, ds.batch(1))  # refused on the device, not yet read
    with pytest.raises(NonFiniteLossError, match="dense update at step 2 ") as e:
        runner.step(state, ds.batch(2), position=2)
    assert host_bits(e.value.state) == committed
    assert int(e.value.state.step) == 1
    t = runner.totals()
    assert (t.steps, t.applied, t.refused) == (3, 1, 2)


@needs_8
def test_skip_nonfinite_counts_refused_steps_and_trains_on():
    runner_kw = {"skip_nonfinite": True}
    setup, state = train_state.create(
        CFG8,
        PLAN8,
        dense=DENSE,
        num_dense=4,
        sparse_optimizer=O.SGD(learning_rate=lambda s: jnp.where(s == 1, jnp.inf, 0.05)),
    )
    runner = StepRunner(setup, **runner_kw)
    ds = SyntheticDataset(CFG8, batch_size=64, num_dense=4, seed=2)
    for i in range(4):
        state, _ = runner.step(state, ds.batch(i))
    runner.sync()
    t = runner.totals()
    # step 2 (optimizer step 1) is refused every time it is retried: inf rate at count 1
    assert t.steps == 4 and t.applied == 1 and t.refused == 3
    assert int(state.step) == 1


@needs_8
def test_a_schedule_changes_the_sparse_rate_every_step_without_recompiling():
    """SGD at rate 0 for the first step, then 0.5: the first step leaves the tables as they
    were, the second moves them, and the runner compiles once."""
    runner, state, ds = make8(O.SGD(learning_rate=lambda s: jnp.where(s >= 1, 0.5, 0.0)))
    tables0 = train_state.full_tables(runner.setup, state)
    state, _ = runner.step(state, ds.batch(0))
    tables1 = train_state.full_tables(runner.setup, state)
    for k in tables0:
        np.testing.assert_array_equal(tables1[k], tables0[k])
    state, _ = runner.step(state, ds.batch(1))
    tables2 = train_state.full_tables(runner.setup, state)
    assert all(not np.array_equal(tables2[k], tables1[k]) for k in tables0)
    for i in range(2, 5):
        state, _ = runner.step(state, ds.batch(i))
    runner.sync()
    assert runner.num_compilations() == 1 and int(state.step) == 5


def test_a_constructor_checked_batch_is_not_checked_twice(monkeypatch):
    """Host checks run once: `Batch.validate` skips the sparse part of a batch its
    constructor already checked against the same config."""
    from embark_jax.data import sparse as sparse_mod

    ds = SyntheticDataset(CFG8, batch_size=64, num_dense=4, seed=2)
    batch = ds.batch(0)
    calls = []
    real = sparse_mod.SparseFeatures.from_dense.__func__
    monkeypatch.setattr(
        sparse_mod.SparseFeatures,
        "from_dense",
        classmethod(lambda cls, *a, **k: calls.append(1) or real(cls, *a, **k)),
    )
    batch.validate(CFG8, num_devices=8, num_dense=4)
    assert calls == []
    rebuilt = jax.tree.map(lambda x: x, batch)  # a pytree rebuilt: checked again
    rebuilt.validate(CFG8, num_devices=8, num_dense=4)
    assert calls == [1]
