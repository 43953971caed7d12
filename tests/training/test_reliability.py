"""Reliability of the checkpoint directory: pruning across runs, atomic re-saves
(an exception injected at every rename, and one real `kill -9`), leftovers cleaned, table
names that cannot leave the checkpoint, writability checked before training, clear errors
for damaged metadata files."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.training import checkpoint as ckpt
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import StepRunner
from embark_jax.training.state import create, full_tables

DENSE = DenseConfig(kind="dcnv2", bottom=(4,), top=(4, 1), cross_layers=1, cross_rank=2)
B = 16


def tiny(
    opt=None,
    *,
    names=("a", "b"),
    dtype=np.float32,
    policy="count",
    factor=None,
    dense_opt=None,
    seed=0,
    **runner_kw,
):
    """A two-table model on 8 devices: (runner, state, dataset)."""
    a, b = names
    tables = [
        TableConfig(name=a, vocab_size=64, dim=4, dtype=dtype),
        TableConfig(name=b, vocab_size=9, dim=4, dtype=dtype),
    ]
    feats = [
        FeatureConfig(name="f", table=a, max_hotness=4),
        FeatureConfig(name="g", table=b, max_hotness=1),
    ]
    cfg = EmbeddingConfig.create(tables, feats)
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=8),
        batch_size=B,
        tables=(
            TablePlan(
                name=a,
                cluster="rb",
                row_shards=4,
                column_shards=1,
                devices=((0, 2, 4, 6),),
                capacity_factor=factor,
            ),
            TablePlan(name=b, cluster="rb", row_shards=1, column_shards=1, devices=((1,),)),
        ),
    )
    setup, state = create(
        cfg,
        plan,
        dense=DENSE,
        sparse_optimizer=opt or O.SGD(learning_rate=0.1),
        dense_optimizer=dense_opt or optax.sgd(0.1),
        options=RuntimeOptions(overflow=policy),
        seed=seed,
    )
    return StepRunner(setup, **runner_kw), state, SyntheticDataset(cfg, batch_size=B, seed=1)


def copy(state):
    """A copy of a state (a step on it cannot donate the original, with any runner)."""
    return jax.tree.map(jnp.copy, state)


def tables_of(runner, state):
    return full_tables(runner.setup, state)


def assert_tables_equal(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def model():
    return tiny()


def test_a_fresh_run_is_not_pruned_by_an_older_runs_steps(tmp_path, model):
    """Pruning keeps the checkpoints saved last, not the highest step numbers (which would
    delete the new run's step 1 at once and leave `latest_step` naming the old run's 102):
    save order decides."""
    runner, state, _ = model
    d = str(tmp_path)
    for step in (100, 101, 102):
        ckpt.save(d, runner.setup, state, step=step)
    ckpt.save(d, runner.setup, state, step=1)
    assert os.path.exists(os.path.join(d, "step_00000001", "meta.json"))
    assert ckpt.latest_step(d) == 1
    assert sorted(os.listdir(d)) == ["step_00000001", "step_00000101", "step_00000102"]
    _new, meta = ckpt.restore(d, runner.setup)
    assert meta["step"] == 1 and meta["sequence"] == 4


def _two_states(model):
    """Two different states that both claim step 1 (a re-save of the same step)."""
    runner, state, ds = model
    s1, _ = runner.step(copy(state), ds.batch(0))
    s2, _ = runner.step(copy(s1), ds.batch(1))
    return runner, s1, s2.replace(step=s1.step)


FAULTS = ["move-old-aside", "move-new-in", "delete-old", "prune"]


def _restored_tables(runner, d):
    state, meta = ckpt.restore(d, runner.setup)
    return tables_of(runner, state), meta


@pytest.mark.parametrize("fault", FAULTS)
def test_resave_leaves_a_restorable_newest_step(tmp_path, model, monkeypatch, fault):
    """The new step_N is renamed into place before the old one is deleted: a complete
    checkpoint of the newest step exists whichever rename or delete a crash hits, and the
    next save cleans up."""
    runner, s1, s2 = _two_states(model)
    d = str(tmp_path)
    ckpt.save(d, runner.setup, s1, step=0, max_to_keep=2)
    ckpt.save(d, runner.setup, s1, max_to_keep=2)
    want = {"old": tables_of(runner, s1), "new": tables_of(runner, s2)}
    with monkeypatch.context() as m:
        real_replace, real_rmtree = os.replace, shutil.rmtree

        def replace(src, dst):
            hit = {
                "move-old-aside": ".old-" in str(dst),
                "move-new-in": ".tmp-" in str(src),
                "prune": ".del-" in str(dst),
            }
            if hit.get(fault):
                raise KeyboardInterrupt(fault)
            return real_replace(src, dst)

        def rmtree(path, *a, **kw):
            if fault == "delete-old" and ".old-" in str(path):
                raise KeyboardInterrupt(fault)
            return real_rmtree(path, *a, **kw)

        m.setattr(os, "replace", replace)
        m.setattr(shutil, "rmtree", rmtree)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(d, runner.setup, s2, max_to_keep=1)
    assert ckpt.latest_step(d) == 1
    got, _meta = _restored_tables(runner, d)
    expect = "old" if fault in ("move-old-aside", "move-new-in") else "new"
    assert_tables_equal(got, want[expect])
    ckpt.save(d, runner.setup, s2, max_to_keep=1)  # the next save cleans every leftover
    assert os.listdir(d) == ["step_00000001"]
    assert_tables_equal(_restored_tables(runner, d)[0], want["new"])


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    from tests.training.test_reliability import tiny
    from embark_jax.training import checkpoint as ckpt
    runner, state, ds = tiny()
    d = sys.argv[1]
    ckpt.save(d, runner.setup, state, step=1)
    state, _ = runner.step(state, ds.batch(0))
    real = os.replace
    def replace(src, dst):
        if ".tmp-" in str(src):  # the old step_1 is aside, the new one not yet in place
            print("BETWEEN", flush=True)
            time.sleep(600)
        return real(src, dst)
    os.replace = replace
    ckpt.save(d, runner.setup, state, step=1)
    """
)


def test_kill_9_between_the_renames_of_a_resave(tmp_path, model):
    """A real `kill -9` at the worst instant of a re-save (old checkpoint aside, new one not
    yet renamed in): step 1 stays restorable, equal to the first save."""
    runner, state, _ = model
    d = str(tmp_path / "ck")
    p = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, d],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        line = p.stdout.readline()
        assert line.strip() == "BETWEEN", line
        assert not os.path.exists(os.path.join(d, "step_00000001"))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert ckpt.latest_step(d) == 1
    got, meta = _restored_tables(runner, d)
    assert ".old-" in meta["path"]
    assert_tables_equal(got, tables_of(runner, state))  # the first save: the initial state
    ckpt.save(d, runner.setup, state, step=2)
    assert sorted(os.listdir(d)) == ["step_00000001", "step_00000002"]  # renamed back


def test_interrupted_save_leftovers_are_cleaned_by_the_next_save(tmp_path, model):
    runner, state, _ = model
    d = str(tmp_path)
    for junk in ("step_00000005.tmp-1a2b", "step_00000004.del-99"):
        os.makedirs(os.path.join(d, junk, "tables"))
    ckpt.save(d, runner.setup, state, step=6)
    assert os.listdir(d) == ["step_00000006"]


def test_table_names_cannot_leave_the_checkpoint(tmp_path):
    """A table named `../../../x` is written inside the checkpoint directory, never to
    `<dir>/../x`."""
    runner, state, _ = tiny(names=("../../../x", "sub/y"))
    d = tmp_path / "ck"
    path = ckpt.save(str(d), runner.setup, state)
    assert sorted(os.listdir(d)) == ["step_00000000"]
    assert sorted(os.listdir(path)) == ["dense", "meta.json", "tables"]
    assert sorted(os.listdir(os.path.join(path, "tables"))) == [
        "%2E%2E%2F%2E%2E%2F%2E%2E%2Fx",
        "sub%2Fy",
    ]
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    new, _ = ckpt.restore(str(d), runner.setup)
    assert_tables_equal(tables_of(runner, new), tables_of(runner, state))


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path, model):
    runner, _, _ = model
    (tmp_path / "file").write_text("not a directory")
    bad = str(tmp_path / "file" / "ck")
    with pytest.raises(PermissionError, match=r"checkpoint directory .*file/ck.* not writable"):
        ckpt.check_writable(bad)
    with pytest.raises(PermissionError, match="not writable"):
        ckpt.CheckpointEvery(bad, runner, every=1, last_step=1)
    with pytest.raises(PermissionError, match=r"file.* exists and is not a directory"):
        ckpt.check_writable(str(tmp_path / "file"))  # not a bare "File exists"
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(PermissionError, match=r"dangling.* exists and is not a directory"):
        ckpt.check_writable(str(tmp_path / "dangling"))
    ckpt.check_writable(str(tmp_path / "new" / "ck"))  # created, probe removed
    assert os.listdir(tmp_path / "new" / "ck") == []


def _damage(path, how):
    meta = os.path.join(path, "meta.json")
    if how == "truncated-meta":
        text = open(meta).read()
        open(meta, "w").write(text[: len(text) // 2])
        return r"meta.json is not valid JSON \(truncated\?\)"
    if how == "meta-missing-tables":
        m = json.load(open(meta))
        del m["tables"]
        json.dump(m, open(meta, "w"))
        return r"meta.json has no field 'tables'"
    if how == "table-entry-missing-dim":
        m = json.load(open(meta))
        del m["tables"]["b"]["dim"]
        json.dump(m, open(meta, "w"))
        return r"meta.json table 'b' has no field 'dim'"
    # the table's own (Orbax) metadata, truncated
    orbax_meta = os.path.join(path, "tables", "b", "_METADATA")
    text = open(orbax_meta).read()
    open(orbax_meta, "w").write(text[: len(text) // 2])
    return r"cannot read table 'b' \(.*tables/b\)"


@pytest.mark.parametrize(
    "how", ["truncated-meta", "meta-missing-tables", "table-entry-missing-dim", "orbax-meta"]
)
def test_damaged_metadata_names_the_file_and_field(tmp_path, model, how):
    """The error names the file and field, not a bare JSONDecodeError / KeyError."""
    runner, state, _ = model
    path = ckpt.save(str(tmp_path), runner.setup, state)
    pattern = _damage(path, how)
    with pytest.raises(ValueError, match=pattern):
        ckpt.restore(str(tmp_path), runner.setup)
