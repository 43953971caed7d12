"""Training with dynamic tables beside fixed ones (`TrainState.dynamic`): the model learns
from raw 64-bit ids, every id is counted, a refused step keeps every value and optimizer
slot, `overflow="error"` refuses drops naming the table, and bad dynamic batches are one
line."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from embark_jax.core.dynamic import (
    DynamicConfig,
    DynamicFeatureConfig,
    DynamicTableConfig,
    key_words,
)
from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.data.batch import DataError
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.sharding.collection import CapacityOverflowError
from embark_jax.training.runner import StepRunner
from embark_jax.training.state import create
from embark_jax.training.step import Refusal, compile_train_step
from tests.training.test_runner import CFG, DENSE

B = 32
PLAN = Plan(
    topology=Topology(num_nodes=1, devices_per_node=8),
    batch_size=B,
    tables=(
        TablePlan(name="rw", cluster="rb", row_shards=4, column_shards=1, devices=((0, 2, 4, 6),)),
        TablePlan(name="tw", cluster="rb", row_shards=1, column_shards=1, devices=((1,),)),
    ),
)


def _dynamic(capacity=64, bucket_size=8, eviction="lru"):
    return DynamicConfig(
        (
            DynamicTableConfig(
                name="hashed", dim=4, capacity=capacity, bucket_size=bucket_size, eviction=eviction
            ),
        ),
        (DynamicFeatureConfig(name="h", table="hashed", max_hotness=1),),
    )


def _setup(dynamic, overflow="count"):
    return create(
        CFG,
        PLAN,
        dense=DENSE,
        sparse_optimizer=O.RowWiseAdagrad(learning_rate=0.5),
        dense_optimizer=optax.adam(0.01),
        options=RuntimeOptions(overflow=overflow),
        dynamic=dynamic,
    )


def _batches(num, seed=0, pool=64):
    """Synthetic fixed features and dense inputs; the label is whether the raw id (a 64-bit
    value) is even: learnable only through the dynamic table."""
    ds = SyntheticDataset(CFG, batch_size=B, seed=seed)
    rng = np.random.default_rng(seed)
    for b in ds.batches(0, num):
        raw = rng.integers(0, pool, B).astype(np.int64) * 0x10000000001 + (1 << 50)
        labels = (raw % 2 == 0).astype(np.float32)
        words = key_words(raw).reshape(B, 1, 2)
        yield dataclasses.replace(b, labels=labels, dynamic={"h": words})


def test_a_model_learns_from_raw_ids_and_every_id_is_counted():
    setup, state = _setup(_dynamic())
    runner = StepRunner(setup)
    losses = []
    for b in _batches(60):
        state, res = runner.step(state, b)
        losses.append(float(res.loss))
    totals = runner.totals()
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10]), losses
    c = totals.dynamic["hashed"]
    assert set(c) == {"found", "inserted", "evicted", "expired", "refused", "dropped", "overflow"}
    assert c["inserted"] <= 64 and c["inserted"] > 40  # 64 distinct ids, each inserted once
    assert c["evicted"] == c["dropped"] == c["overflow"] == 0
    assert "hashed" not in totals.overflow and totals.applied == 60
    assert runner.num_compilations() == 1
    auc = runner.evaluate(state, _batches(4, seed=9))["auc"]
    assert auc > 0.9


def test_a_refused_step_keeps_every_value_and_slot():
    setup, state = _setup(_dynamic())
    step = compile_train_step(setup)
    batches = list(_batches(3))
    state, _ = step(state, batches[0])
    values = np.asarray(state.dynamic["hashed"].values)
    acc = np.asarray(state.dynamic["hashed"].opt_state.accumulator)
    state, m = step(state, batches[1], allow=False)
    assert int(m["status"]) == int(Refusal.HALTED) and int(state.step) == 1
    new = state.dynamic["hashed"]
    np.testing.assert_array_equal(np.asarray(new.opt_state.accumulator), acc)
    # rows held before keep their bits; rows of ids this step inserted hold their initial rows
    held = np.asarray(new.scores)[..., 1] > 0
    fresh = np.asarray(new.scores)[..., 0] == 1
    old = held & ~fresh
    assert old.sum() > 0
    np.testing.assert_array_equal(np.asarray(new.values)[old], values[old])
    refused = np.asarray(new.values)
    state, m = step(state, batches[1])  # the same batch, committed: its rows move
    assert bool(m["applied"]) and int(state.step) == 2
    touched = held & fresh
    assert touched.sum() > 0
    after = np.asarray(state.dynamic["hashed"].values)
    moved = np.abs(after[touched] - refused[touched]).max(axis=-1) > 0
    assert moved.mean() > 0.9, moved  # (a zero gradient may leave a row as it was)


def test_overflow_error_refuses_dropped_ids_naming_the_table():
    tiny = _dynamic(capacity=1, bucket_size=1, eviction="none")
    setup, state = _setup(tiny, overflow="error")
    runner = StepRunner(setup)
    with pytest.raises(CapacityOverflowError, match=r"ids dropped per table: \{'hashed': \d+\}"):
        for b in _batches(2):
            state, _ = runner.step(state, b)
        runner.sync()


def test_bad_dynamic_batches_are_one_line_errors():
    setup, state = _setup(_dynamic())
    runner = StepRunner(setup)
    b = next(_batches(1))
    with pytest.raises(
        DataError, match=r"dynamic features: the batch has \[\], the model takes \['h'\]"
    ):
        runner.place(dataclasses.replace(b, dynamic={}))
    wrong = dataclasses.replace(b, dynamic={"h": np.zeros((B, 1), np.int64)})
    with pytest.raises(DataError, match=r"dynamic feature 'h': ids must be uint32 \[32, 1, 2\]"):
        runner.place(wrong)
    with pytest.raises(ValueError, match=r"dynamic names \['rw'\] are also fixed tables"):
        clash = DynamicConfig(
            (DynamicTableConfig(name="rw", dim=4, capacity=8, bucket_size=8),),
            (DynamicFeatureConfig(name="x", table="rw"),),
        )
        _setup(clash)
    assert jax.tree.leaves(state.dynamic)


def test_a_checkpoint_restores_dynamic_tables_and_training_goes_on_the_same(tmp_path):
    """Saved in logical form and rehashed on restore: the next step's loss and outputs are
    those of the run that never stopped; a setup without the dynamic table is refused."""
    from embark_jax.training import checkpoint as ckpt

    setup, state = _setup(_dynamic())
    step = compile_train_step(setup)
    batches = list(_batches(4))
    for b in batches[:3]:
        state, _ = step(state, b)
    ckpt.save(str(tmp_path), setup, state)
    restored, meta = ckpt.restore(str(tmp_path), setup)
    assert meta["tables"]["hashed"]["rows"] > 40
    _, want = step(state, batches[3])
    _, got = step(restored, batches[3])
    np.testing.assert_array_equal(np.asarray(got["loss"]), np.asarray(want["loss"]))
    np.testing.assert_array_equal(np.asarray(got["dynamic"]), np.asarray(want["dynamic"]))
    plain, _ = create(CFG, PLAN, dense=DENSE, sparse_optimizer=O.RowWiseAdagrad(learning_rate=0.5))
    with pytest.raises(ValueError, match=r"dynamic tables \['hashed'\], the setup has \[\]"):
        ckpt.restore(str(tmp_path), plain)
    wide = _dynamic()
    wide = dataclasses.replace(
        wide, tables=(dataclasses.replace(wide.tables[0], dim=8),)
    )  # the dense model's inputs change too: the dynamic table is named, not a dense param
    with pytest.raises(
        ValueError,
        match=r"^dynamic table 'hashed': checkpoint has dim 4 float32, the setup 8 float32$",
    ):
        ckpt.restore(str(tmp_path), _setup(wide)[0])


def test_readme_dynamic_training_example_runs(tmp_path):
    from tests.test_readme import readme_python_blocks, run_clean

    blocks = [b for b in readme_python_blocks() if "DynamicConfig(" in b]
    assert len(blocks) == 1
    r = run_clean(blocks[0], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    want = blocks[0].splitlines()[-1].lstrip("# ")  # the comment shows the output
    assert r.stdout.strip().splitlines()[-1] == want


@pytest.mark.parametrize("saved, restored", [(True, True), (True, False), (False, True)])
def test_a_replicated_dynamic_table_checkpoints_onto_either_placement(tmp_path, saved, restored):
    """A table held whole on every device (`replicated`) is saved once (not 8 copies) and
    restored onto a replicated or a sharded setup, and vice versa: the next step's loss is
    the uninterrupted run's (bit for bit onto the same placement)."""
    from embark_jax.training import checkpoint as ckpt

    def config(replicated):
        d = _dynamic(capacity=512 if replicated else 64)
        return dataclasses.replace(d, replicated=("hashed",) if replicated else ())

    setup, state = _setup(config(saved))
    step = compile_train_step(setup)
    batches = list(_batches(4))
    for b in batches[:3]:
        state, _ = step(state, b)
    ckpt.save(str(tmp_path), setup, state)
    target, _ = _setup(config(restored))
    back, meta = ckpt.restore(str(tmp_path), target)
    assert 40 < meta["tables"]["hashed"]["rows"] <= 64  # each id once
    _, want = step(state, batches[3])
    _, got = compile_train_step(target)(back, batches[3])
    if saved == restored:
        np.testing.assert_array_equal(np.asarray(got["loss"]), np.asarray(want["loss"]))
    else:
        np.testing.assert_allclose(np.asarray(got["loss"]), np.asarray(want["loss"]), rtol=1e-5)


def _one_shard_batches(num, hot=16):
    """Batches whose dynamic ids are all distinct and all owned by shard 0: each device's
    b x hot unique ids go to one owner, past its binomial routing bucket."""
    from embark_jax.core.dynamic import shard_of

    rng = np.random.default_rng(7)
    pool = rng.integers(1, 2**62, 200_000).astype(np.int64)
    pool = pool[shard_of(key_words(pool), 8) == 0]
    ds = SyntheticDataset(CFG, batch_size=B, seed=0)
    for i, b in enumerate(ds.batches(0, num)):
        raw = pool[i * B * hot : (i + 1) * B * hot]
        yield dataclasses.replace(b, dynamic={"h": key_words(raw).reshape(B, hot, 2)})


@pytest.mark.parametrize("policy", ["count", "grow"])
def test_routing_overflow_grows_the_buckets_under_grow_and_is_counted_under_count(policy):
    """All of a step's dynamic ids owned by one shard overflow its routing bucket; under
    `grow` the runner doubles that table's buckets (one step late, as for fixed tables)
    until nothing overflows, under `count` every step counts its overflow."""
    cfg = DynamicConfig(
        (DynamicTableConfig(name="hashed", dim=4, capacity=4096),),
        (DynamicFeatureConfig(name="h", table="hashed", max_hotness=16),),
    )
    setup, state = _setup(cfg, overflow=policy)
    runner = StepRunner(setup)
    lost, last = [], runner.totals()
    for b in _one_shard_batches(6):
        state, _ = runner.step(state, b)
        now = runner.totals()
        lost.append(now.since(last).dynamic["hashed"]["overflow"])
        last = now
    assert lost[0] > 0
    if policy == "grow":
        assert lost[-1] == 0 and lost[-2] == 0, lost
        assert runner.setup.dynamic.route_scale["hashed"] >= 2
        assert runner.setup.dynamic.capacity(cfg.tables[0], B // 8) == B // 8 * 16
    else:
        assert all(v == lost[0] for v in lost), lost  # the same overflow every step
        assert runner.setup.dynamic.route_scale == {}
