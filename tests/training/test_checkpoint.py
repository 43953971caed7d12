"""Orbax checkpoints: bit-exact round trips, resharding to another plan and device count,
resume equals uninterrupted, atomic saves (single-table export/import: test_table_io.py)."""

import os
import re

import jax
import numpy as np
import optax
import pytest

from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.planner import PRESETS, ModelSpec, baseline, plan
from embark_jax.training import checkpoint as ckpt
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import StepRunner
from embark_jax.training.state import create, full_tables
from tests.training.test_step import CFG, mixed_plan

DENSE = DenseConfig(kind="dcnv2", bottom=(8, 8), top=(8, 1), cross_layers=1, cross_rank=4)
OPT = O.Adam(learning_rate=0.05)  # two slots and a counter: the hardest state to move
B = 32


class Run:
    """A runner and the state it trains (the test's one owner of that state)."""

    def __init__(self, p, seed=0, opt=OPT):
        setup, self.state = create(
            CFG, p, dense=DENSE, sparse_optimizer=opt, dense_optimizer=optax.adam(1e-2), seed=seed
        )
        self.runner = StepRunner(setup)
        self.setup = setup

    def step(self, batch):
        self.state, r = self.runner.step(self.state, batch)
        return r

    def save(self, directory, **kw):
        return ckpt.save(directory, self.setup, self.state, **kw)

    def restore(self, directory, **kw):
        self.state, meta = ckpt.restore(directory, self.setup, **kw)
        return meta


def trainer(p, seed=0, opt=OPT):
    return Run(p, seed, opt)


def all_tables(tr):
    lw = tr.setup.lowered
    return {
        t.name: ckpt.table_arrays(lw, t.name, tr.state.tables, tr.state.slots)
        for t in lw.plan.tables
    }


def assert_same_state(a, b, dense=True):
    """Equal logical states. Tables are read through `Lowered.unstack` (`full_tables`), not
    through `table_arrays`, the function the checkpoints use; `table_arrays`' own reading of
    each table is checked against it, so a slot it misplaces by the same rule shows too."""
    ta, tb = all_tables(a), all_tables(b)
    fa, fb = full_tables(a.setup, a.state), full_tables(b.setup, b.state)
    for name in ta:
        np.testing.assert_array_equal(fa[name], fb[name], err_msg=name)
        np.testing.assert_array_equal(ta[name]["table"], fa[name], err_msg=f"{name}: read")
        np.testing.assert_array_equal(tb[name]["table"], fb[name], err_msg=f"{name}: read")
        assert sorted(ta[name]["slots"]) == sorted(tb[name]["slots"])
        for k in ta[name]["slots"]:
            np.testing.assert_array_equal(
                ta[name]["slots"][k], tb[name]["slots"][k], err_msg=f"{name}/{k}"
            )
    if dense:
        for x, y in zip(
            jax.tree.leaves((a.state.dense_params, a.state.dense_opt, a.state.rng)),
            jax.tree.leaves((b.state.dense_params, b.state.dense_opt, b.state.rng)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def planner_plan(devices=8, nodes=2):
    spec = ModelSpec.from_config(CFG, slot_footprint=OPT.slot_footprint)
    hw = PRESETS["dgx-h100"].with_shape(nodes, devices // nodes)
    return spec, hw, plan(spec, B, hw)


def test_round_trip_is_bit_exact(tmp_path):
    ds = SyntheticDataset(CFG, batch_size=B, seed=1)
    a = trainer(mixed_plan())
    for i in range(2):
        a.step(ds.batch(i))
    path = a.save(str(tmp_path), data_position=2)
    assert ckpt.latest_step(str(tmp_path)) == 2 and path.endswith("step_00000002")
    b = trainer(mixed_plan(), seed=7)  # different initial values everywhere
    meta = b.restore(str(tmp_path))
    assert meta["data_position"] == 2 and int(b.state.step) == 2
    assert_same_state(a, b)


def test_relative_directories_save_and_restore(tmp_path, monkeypatch):
    """Relative directories save and restore (Orbax alone refuses them: "Checkpoint path
    should be absolute"), leaving only the committed step in the directory."""
    ds = SyntheticDataset(CFG, batch_size=B, seed=1)
    a = trainer(mixed_plan())
    a.step(ds.batch(0))
    monkeypatch.chdir(tmp_path)
    path = a.save("ck")
    assert path == str(tmp_path / "ck" / "step_00000001")
    b = trainer(mixed_plan(), seed=7)
    assert b.restore("ck")["path"] == path
    assert_same_state(a, b)
    assert sorted(os.listdir(tmp_path / "ck")) == ["step_00000001"]


def test_files_where_checkpoints_go_are_replaced_and_cleaned(tmp_path):
    """A plain file at step_N, or left under a leftover's name, is removed by the next
    commit, so no step_N.old-* is left behind by a silently failing rmtree."""
    a = trainer(mixed_plan())
    d = tmp_path / "ck"
    d.mkdir()
    for name in ("step_00000001", "step_00000003.old-x", "step_00000004.tmp-y", "step_5.del-z"):
        (d / name).write_text("not a checkpoint")
    elsewhere = tmp_path / "elsewhere"  # a complete checkpoint outside, linked in
    elsewhere.mkdir()
    (elsewhere / "meta.json").write_text("{}")
    (d / "step_00000003.old-l").symlink_to(elsewhere)  # removed, not renamed to step_00000003
    (d / "step_00000006.tmp-l").symlink_to(tmp_path / "nowhere")
    path = a.save(str(d), step=1)
    assert sorted(os.listdir(d)) == ["step_00000001"]
    assert sorted(os.listdir(elsewhere)) == ["meta.json"]  # the link went, not its target
    b = trainer(mixed_plan(), seed=7)
    assert b.restore(str(d))["path"] == path
    assert_same_state(a, b)
    (d / "step_00000009").write_text("not ours")  # not a checkpoint: ignored and kept
    a.save(str(d), step=2, max_to_keep=1)
    assert sorted(os.listdir(d)) == ["step_00000002", "step_00000009"]
    assert ckpt.latest_step(str(d)) == 2
    with pytest.raises(NotADirectoryError, match="step_00000009' is not a directory"):
        a.save(str(d / "step_00000009"))  # names the checkpoint, not a .tmp- path


def test_a_step_that_will_not_go_blocks_no_later_save(tmp_path, monkeypatch):
    """A complete step_1.old-* next to an incomplete step_1 that cannot be deleted (a
    read-only subdirectory, as another user): the put-back rename failed, and so did every
    later save. Now the old copy stays and is still found; a prune that fails warns."""
    from embark_jax.training import checkpoint_dir

    a = trainer(mixed_plan())
    d = tmp_path / "ck"
    a.save(str(d), step=1)
    os.rename(d / "step_00000001", d / "step_00000001.old-x")
    (d / "step_00000001" / "ro").mkdir(parents=True)
    (d / "step_00000001" / "ro" / "f").write_text("x")
    real = checkpoint_dir._delete
    monkeypatch.setattr(
        checkpoint_dir, "_delete", lambda p: None if p.endswith("step_00000001") else real(p)
    )
    a.save(str(d), step=2, max_to_keep=None)  # no OSError "Directory not empty"
    assert sorted(os.listdir(d)) == ["step_00000001", "step_00000001.old-x", "step_00000002"]
    assert ckpt.resolve(str(d), 1).endswith("step_00000001.old-x")
    b = trainer(mixed_plan(), seed=7)
    b.restore(str(d), step=1)
    assert_same_state(a, b)

    def refuse(path, tag):
        raise PermissionError(f"cannot move {path}")

    monkeypatch.setattr(checkpoint_dir, "_remove", refuse)
    with pytest.warns(UserWarning, match="checkpoint saved, but .* could not be pruned"):
        path = a.save(str(d), step=3, max_to_keep=1)
    assert ckpt.latest_step(str(d)) == 3 and os.path.isdir(path)


def test_restore_onto_4_devices_with_trw(tmp_path):
    """Saved from the planner's plan on 8 devices, restored onto TRW on 4: every row and
    every optimizer slot arrives bit-exact."""
    spec, _, ev = planner_plan()
    ds = SyntheticDataset(CFG, batch_size=B, seed=2)
    a = trainer(ev.plan)
    for i in range(2):
        a.step(ds.batch(i))
    a.save(str(tmp_path))
    trw = baseline(spec, B, PRESETS["dgx-h100"].with_shape(2, 2), "trw").plan
    assert trw.topology.num_devices == 4 and trw != ev.plan
    b = trainer(trw, seed=3)
    b.restore(str(tmp_path))
    assert_same_state(a, b)


@pytest.mark.parametrize("same_plan", [True, False], ids=["same-plan", "other-plan"])
def test_resume_equals_uninterrupted(tmp_path, same_plan):
    ds = SyntheticDataset(CFG, batch_size=B, seed=4)
    n, m = 3, 3
    full = trainer(mixed_plan())
    losses = [full.step(ds.batch(i)).loss for i in range(n + m)]

    first = trainer(mixed_plan())
    for i in range(n):
        first.step(ds.batch(i))
    first.save(str(tmp_path), data_position=n)
    other = planner_plan()[2].plan if not same_plan else mixed_plan()
    resumed = trainer(other, seed=9)
    pos = resumed.restore(str(tmp_path))["data_position"]
    tail = [resumed.step(ds.batch(pos + i)).loss for i in range(m)]
    if same_plan:
        assert tail == losses[n:]  # exactly
    else:
        np.testing.assert_allclose(tail, losses[n:], rtol=1e-5)


def _second_save_fails(tmp_path, monkeypatch, error, at):
    """A model saved at step 1 and stepped once more, then saved again with table_arrays
    raising `error` at its `at`-th call; returns the model (step 2, not saved)."""
    ds = SyntheticDataset(CFG, batch_size=B, seed=6)
    a = trainer(mixed_plan())
    a.step(ds.batch(0))
    a.save(str(tmp_path))
    a.step(ds.batch(1))
    real, calls = ckpt.table_arrays, []

    def dying(*args, **kw):
        calls.append(1)
        if len(calls) == at:
            raise error
        return real(*args, **kw)

    monkeypatch.setattr(ckpt, "table_arrays", dying)
    with pytest.raises(type(error), match=re.escape(str(error))):
        a.save(str(tmp_path))
    monkeypatch.undo()
    return a


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    a = _second_save_fails(tmp_path, monkeypatch, KeyboardInterrupt("killed mid-save"), 3)
    assert ckpt.latest_step(str(tmp_path)) == 1  # the partial step-2 save is invisible
    assert any(".tmp-" in n for n in os.listdir(tmp_path))
    b = trainer(mixed_plan(), seed=8)
    assert b.restore(str(tmp_path))["step"] == 1
    a.save(str(tmp_path))  # the next save cleans the interrupted one's leftovers
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]


def test_a_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    """An error while writing (not a kill) removes the half-written step at once."""
    _second_save_fails(tmp_path, monkeypatch, OSError("disk full"), 2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]
    assert ckpt.latest_step(str(tmp_path)) == 1


@pytest.mark.parametrize(
    "kw, pattern",
    [
        ({"step": -1}, r"step must be in \[0, 2147483647\], got -1"),
        ({"step": 2**31}, r"step must be in \[0, 2147483647\], got 2147483648"),
        ({"step": True}, r"step must be an integer, got True"),
        ({"data_position": 1.5}, r"data_position must be an integer, got 1.5"),
        ({"data_position": -1}, r"data_position must be in \[0, \d+\], got -1"),
    ],
)
def test_save_refuses_what_restore_would_refuse(tmp_path, kw, pattern):
    """A save refuses these at once, rather than writing a checkpoint whose restore fails
    (or a step -1 that is never found)."""
    a = trainer(mixed_plan())
    with pytest.raises(ValueError, match=pattern):
        a.save(str(tmp_path), **kw)
    assert os.listdir(tmp_path) == []


def test_numpy_integers_are_saved_as_integers(tmp_path):
    """numpy integers (`data_position=np.int32(3)`) go into the JSON as integers: no json.dump
    failure, no temporary directory left."""
    a = trainer(mixed_plan())
    a.save(str(tmp_path), step=np.int64(4), data_position=np.int32(3))
    assert sorted(os.listdir(tmp_path)) == ["step_00000004"]
    b = trainer(mixed_plan(), seed=7)
    meta = b.restore(str(tmp_path))
    assert (meta["step"], meta["data_position"]) == (4, 3)


def test_a_dense_directory_copied_from_another_step_is_refused(tmp_path):
    import shutil

    ds = SyntheticDataset(CFG, batch_size=B, seed=3)
    a = trainer(mixed_plan())
    a.step(ds.batch(0))
    a.save(str(tmp_path))
    a.step(ds.batch(1))
    a.save(str(tmp_path))
    one, two = (tmp_path / f"step_0000000{i}" / "dense" for i in (1, 2))
    shutil.rmtree(two)
    shutil.copytree(one, two)
    b = trainer(mixed_plan(), seed=7)
    with pytest.raises(
        ValueError,
        match=r"^checkpoint .*step_00000002: .*step_00000002/dense does not match the "
        r"fingerprint recorded for step 2 \(dense parameters copied from another",
    ):
        b.restore(str(tmp_path))
    assert b.restore(str(tmp_path), step=1)["step"] == 1  # the untouched one restores


def test_the_longest_table_name_allowed_saves_and_restores(tmp_path):
    """A name the config accepts must be one a save can write (Orbax adds its own suffix to
    the table's directory while it writes)."""
    from embark_jax.core.plan import Plan, TablePlan, Topology
    from embark_jax.core.specs import (
        MAX_TABLE_DIRNAME,
        EmbeddingConfig,
        FeatureConfig,
        TableConfig,
        table_dirname,
    )

    name = "t." * (MAX_TABLE_DIRNAME // 4)  # "." takes 3: exactly the limit
    assert len(table_dirname(name)) == MAX_TABLE_DIRNAME
    config = EmbeddingConfig.create(
        [TableConfig(name=name, vocab_size=8, dim=4)],
        [FeatureConfig(name="f", table=name, max_hotness=1)],
    )
    every = (tuple(range(8)),)
    p = Plan(
        topology=Topology(num_nodes=1, devices_per_node=8),
        batch_size=8,
        tables=(TablePlan(name=name, cluster="dp", row_shards=1, column_shards=1, devices=every),),
    )
    setup, state = create(config, p, dense=DENSE, sparse_optimizer=O.SGD(learning_rate=0.1))
    ckpt.save(str(tmp_path), setup, state)
    assert ckpt.restore(str(tmp_path), setup)[1]["step"] == 0


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_damaged_newest_meta_json_is_skipped_with_a_warning(tmp_path, damage):
    ds = SyntheticDataset(CFG, batch_size=B, seed=3)
    a = trainer(mixed_plan())
    for i in range(2):
        a.step(ds.batch(i))
        a.save(str(tmp_path))
    meta = tmp_path / "step_00000002" / "meta.json"
    if damage == "deleted":
        meta.unlink()
        why = "its meta.json is missing"
    else:
        meta.write_text(meta.read_text()[:40])
        why = r"its meta.json cannot be read \(truncated\?\)"
    message = (
        rf"^checkpoint step 2 skipped: {why} \(.*step_00000002\); the latest checkpoint is step 1$"
    )
    with pytest.warns(UserWarning, match=message):
        assert ckpt.latest_step(str(tmp_path)) == 1
    with pytest.warns(UserWarning, match=message):
        assert a.restore(str(tmp_path))["step"] == 1
    for other in tmp_path.glob("step_*/meta.json"):  # nothing left to fall back to
        other.unlink()
    with pytest.warns(UserWarning, match=r"no other complete checkpoint is there"):
        assert ckpt.latest_step(str(tmp_path)) is None


def test_restore_rejects_mismatched_tables(tmp_path):
    a = trainer(mixed_plan())
    a.save(str(tmp_path))
    with pytest.raises(ValueError, match="saved with another optimizer"):
        trainer(mixed_plan(), opt=O.Adagrad(learning_rate=0.1)).restore(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        a.restore(str(tmp_path / "nothing"))


def test_async_save_snapshots_the_state_while_training_goes_on(tmp_path):
    ds = SyntheticDataset(CFG, batch_size=B, seed=12)
    a = trainer(mixed_plan())
    a.step(ds.batch(0))
    want = all_tables(a)
    pending = ckpt.save_async(str(tmp_path), a.setup, a.state, data_position=1)
    for i in range(1, 3):  # donates and changes the live state meanwhile
        a.step(ds.batch(i))
    assert pending.wait().endswith("step_00000001") and pending.done()
    b = trainer(mixed_plan(), seed=5)
    b.restore(str(tmp_path))
    got = all_tables(b)
    for name in want:
        np.testing.assert_array_equal(got[name]["table"], want[name]["table"])


def test_failed_restore_leaves_the_live_state_usable(tmp_path):
    """A restore builds a new state: when it fails half way (the last table's files are
    damaged), the live state is unchanged and the next step runs."""
    import shutil

    ds = SyntheticDataset(CFG, batch_size=B, seed=13)
    a = trainer(mixed_plan())
    a.step(ds.batch(0))
    path = a.save(str(tmp_path))
    b = trainer(mixed_plan(), seed=3)
    b.step(ds.batch(0))
    before = all_tables(b)
    last = b.setup.plan.tables[-1].name
    shutil.rmtree(os.path.join(path, "tables", last))
    with pytest.raises(Exception, match=last):
        b.restore(str(tmp_path))
    after = all_tables(b)  # every buffer is still alive and unchanged
    for name in before:
        np.testing.assert_array_equal(after[name]["table"], before[name]["table"])
    assert np.isfinite(b.step(ds.batch(1)).loss)
