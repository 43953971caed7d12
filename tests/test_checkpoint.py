"""Orbax checkpoints: bit-exact round trips, resharding to another plan and device count,
resume equals uninterrupted, single-table export/import, atomic saves."""

import os

import jax
import numpy as np
import optax
import pytest

from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.ops import optimizers as O
from embark_jax.planner import PRESETS, ModelSpec, baseline, plan
from embark_jax.training import checkpoint as ckpt
from embark_jax.training.models import DenseConfig
from embark_jax.training.trainer import Trainer
from tests.test_train import CFG, mixed_plan

DENSE = DenseConfig(kind="dcnv2", bottom=(8, 8), top=(8, 1), cross_layers=1, cross_rank=4)
OPT = O.Adam(learning_rate=0.05)  # two slots and a counter: the hardest state to move
B = 32


def trainer(p, seed=0, opt=OPT):
    return Trainer(
        CFG, p, dense=DENSE, sparse_optimizer=opt, dense_optimizer=optax.adam(1e-2), seed=seed
    )


def all_tables(tr):
    lw = tr.collection.lowered
    return {
        t.name: ckpt.table_arrays(lw, t.name, tr.state["emb"], tr.state["emb_opt"])
        for t in lw.plan.tables
    }


def assert_same_state(a, b, dense=True):
    ta, tb = all_tables(a), all_tables(b)
    for name in ta:
        np.testing.assert_array_equal(ta[name]["table"], tb[name]["table"], err_msg=name)
        assert sorted(ta[name]["slots"]) == sorted(tb[name]["slots"])
        for k in ta[name]["slots"]:
            np.testing.assert_array_equal(
                ta[name]["slots"][k], tb[name]["slots"][k], err_msg=f"{name}/{k}"
            )
    if dense:
        for x, y in zip(
            jax.tree.leaves(a.state["dense"]), jax.tree.leaves(b.state["dense"]), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def planner_plan(devices=8, nodes=2):
    spec = ModelSpec.from_config(CFG, OPT)
    hw = PRESETS["dgx-h100"].with_shape(nodes, devices // nodes)
    return spec, hw, plan(spec, B, hw)


def test_round_trip_is_bit_exact(tmp_path):
    ds = SyntheticDataset(CFG, batch_size=B, seed=1)
    a = trainer(mixed_plan())
    for i in range(2):
        a.step(ds.batch(i))
    path = ckpt.save(str(tmp_path), a, data_position=2)
    assert ckpt.latest_step(str(tmp_path)) == 2 and path.endswith("step_00000002")
    b = trainer(mixed_plan(), seed=7)  # different initial values everywhere
    meta = ckpt.restore(str(tmp_path), b)
    assert meta["data_position"] == 2 and int(b.state["step"]) == 2
    assert_same_state(a, b)


def test_restore_onto_4_devices_with_trw(tmp_path):
    """Saved from the planner's plan on 8 devices, restored onto TRW on 4: every row and
    every optimizer slot arrives bit-exact."""
    spec, _, ev = planner_plan()
    ds = SyntheticDataset(CFG, batch_size=B, seed=2)
    a = trainer(ev.plan)
    for i in range(2):
        a.step(ds.batch(i))
    ckpt.save(str(tmp_path), a)
    trw = baseline(spec, B, PRESETS["dgx-h100"].with_shape(2, 2), "trw").plan
    assert trw.topology.num_devices == 4 and trw != ev.plan
    b = trainer(trw, seed=3)
    ckpt.restore(str(tmp_path), b)
    assert_same_state(a, b)


@pytest.mark.parametrize("same_plan", [True, False], ids=["same-plan", "other-plan"])
def test_resume_equals_uninterrupted(tmp_path, same_plan):
    ds = SyntheticDataset(CFG, batch_size=B, seed=4)
    n, m = 3, 3
    full = trainer(mixed_plan())
    losses = [full.step(ds.batch(i))["loss"] for i in range(n + m)]

    first = trainer(mixed_plan())
    for i in range(n):
        first.step(ds.batch(i))
    ckpt.save(str(tmp_path), first, data_position=n)
    other = planner_plan()[2].plan if not same_plan else mixed_plan()
    resumed = trainer(other, seed=9)
    pos = ckpt.restore(str(tmp_path), resumed)["data_position"]
    tail = [resumed.step(ds.batch(pos + i))["loss"] for i in range(m)]
    if same_plan:
        assert tail == losses[n:]  # exactly
    else:
        np.testing.assert_allclose(tail, losses[n:], rtol=1e-5)


def test_export_import_single_tables(tmp_path):
    a = trainer(mixed_plan())
    a.step(SyntheticDataset(CFG, batch_size=B, seed=5).batch(0))
    ckpt.export_table(a, "rw", str(tmp_path / "rw.npy"))
    ckpt.export_table(a, "rc", str(tmp_path / "rc.npz"))
    want_rw = all_tables(a)["rw"]["table"]
    np.testing.assert_array_equal(np.load(tmp_path / "rw.npy"), want_rw)
    b = trainer(mixed_plan(), seed=11)
    ckpt.import_table(b, "rw", str(tmp_path / "rw.npy"))
    ckpt.import_table(b, "rc", str(tmp_path / "rc.npz"))
    got = all_tables(b)
    np.testing.assert_array_equal(got["rw"]["table"], want_rw)
    np.testing.assert_array_equal(got["rc"]["table"], all_tables(a)["rc"]["table"])
    np.testing.assert_array_equal(got["rc"]["slots"]["m"], all_tables(a)["rc"]["slots"]["m"])
    with pytest.raises(ValueError, match=r"table 'rw': checkpoint shape \(3, 8\) != configured"):
        np.save(tmp_path / "bad.npy", np.zeros((3, 8), np.float32))
        ckpt.import_table(b, "rw", str(tmp_path / "bad.npy"))


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ds = SyntheticDataset(CFG, batch_size=B, seed=6)
    a = trainer(mixed_plan())
    a.step(ds.batch(0))
    ckpt.save(str(tmp_path), a)
    a.step(ds.batch(1))
    calls = {"n": 0}
    real = ckpt.table_arrays

    def dying(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed mid-save")
        return real(*args, **kw)

    monkeypatch.setattr(ckpt, "table_arrays", dying)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(str(tmp_path), a)
    monkeypatch.undo()
    assert ckpt.latest_step(str(tmp_path)) == 1  # the partial step-2 save is invisible
    assert any(".tmp-" in n for n in os.listdir(tmp_path))
    b = trainer(mixed_plan(), seed=8)
    assert ckpt.restore(str(tmp_path), b)["step"] == 1


def test_restore_rejects_mismatched_tables(tmp_path):
    a = trainer(mixed_plan())
    ckpt.save(str(tmp_path), a)
    with pytest.raises(ValueError, match="saved with another optimizer"):
        ckpt.restore(str(tmp_path), trainer(mixed_plan(), opt=O.Adagrad(learning_rate=0.1)))
    with pytest.raises(FileNotFoundError):
        ckpt.restore(str(tmp_path / "nothing"), a)


def test_async_save_snapshots_the_state_while_training_goes_on(tmp_path):
    ds = SyntheticDataset(CFG, batch_size=B, seed=12)
    a = trainer(mixed_plan())
    a.step(ds.batch(0))
    want = all_tables(a)
    pending = ckpt.save_async(str(tmp_path), a, data_position=1)
    for i in range(1, 3):  # donates and changes the live state meanwhile
        a.step(ds.batch(i))
    assert pending.wait().endswith("step_00000001") and pending.done()
    b = trainer(mixed_plan(), seed=5)
    ckpt.restore(str(tmp_path), b)
    got = all_tables(b)
    for name in want:
        np.testing.assert_array_equal(got[name]["table"], want[name]["table"])
