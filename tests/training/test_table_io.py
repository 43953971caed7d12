"""`embark_jax.training.table_io`: one table exported to and imported from .npy/.npz files,
checked against the model's table (shape, dtype, slots) with one-line errors naming it."""

import numpy as np
import pytest

from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.training import checkpoint as ckpt
from tests.training.test_checkpoint import B, all_tables, trainer
from tests.training.test_step import CFG, mixed_plan


def test_export_import_single_tables(tmp_path):
    a = trainer(mixed_plan())
    a.step(SyntheticDataset(CFG, batch_size=B, seed=5).batch(0))
    ckpt.export_table(a.setup, a.state, "rw", str(tmp_path / "rw.npy"))
    ckpt.export_table(a.setup, a.state, "rc", str(tmp_path / "rc.npz"))
    want_rw = all_tables(a)["rw"]["table"]
    np.testing.assert_array_equal(np.load(tmp_path / "rw.npy"), want_rw)
    b = trainer(mixed_plan(), seed=11)
    b.state = ckpt.import_table(b.setup, b.state, "rw", str(tmp_path / "rw.npy"))
    b.state = ckpt.import_table(b.setup, b.state, "rc", str(tmp_path / "rc.npz"))
    got = all_tables(b)
    np.testing.assert_array_equal(got["rw"]["table"], want_rw)
    np.testing.assert_array_equal(got["rc"]["table"], all_tables(a)["rc"]["table"])
    np.testing.assert_array_equal(got["rc"]["slots"]["m"], all_tables(a)["rc"]["slots"]["m"])
    with pytest.raises(ValueError, match=r"table 'rw': checkpoint shape \(3, 8\) != configured"):
        np.save(tmp_path / "bad.npy", np.zeros((3, 8), np.float32))
        ckpt.import_table(b.setup, b.state, "rw", str(tmp_path / "bad.npy"))


def test_import_table_failures_are_one_line_naming_the_table(tmp_path):
    a = trainer(mixed_plan())
    good = all_tables(a)["rw"]["table"]
    np.save(tmp_path / "objects.npy", np.array([{"x": 1}, 2], dtype=object), allow_pickle=True)
    np.save(tmp_path / "full.npy", good)
    (tmp_path / "truncated.npy").write_bytes((tmp_path / "full.npy").read_bytes()[:300])
    (tmp_path / "text.npy").write_text("0.1 0.2 0.3\n")
    np.savez(tmp_path / "full.npz", table=good)
    (tmp_path / "truncated.npz").write_bytes((tmp_path / "full.npz").read_bytes()[:200])
    np.save(tmp_path / "ints.npy", np.ones(good.shape, np.int64))
    np.savez(tmp_path / "int_slot.npz", table=good, slot_m=np.ones(good.shape, np.int32))
    cases = {
        "objects.npy": "cannot read .*objects.npy: it holds Python objects",
        "truncated.npy": "cannot read .*truncated.npy: Failed to read all data",
        "text.npy": ".*text.npy is not a .npy file",
        "truncated.npz": ".*truncated.npz is not an .npz archive|cannot read .*truncated.npz",
        "missing.npy": "cannot read .*missing.npy: No such file",
        "ints.npy": r"table in .*ints.npy is int64, not floats; the table is float32 \(not "
        "converted",
        "int_slot.npz": "slot 'm' in .*int_slot.npz is int32, not floats",
    }
    for file, message in cases.items():
        with pytest.raises(ValueError, match=rf"^table 'rw': ({message})"):
            ckpt.import_table(a.setup, a.state, "rw", str(tmp_path / file))
    with pytest.raises(ValueError, match=r"^import_table: unknown table 'nope'; the model's"):
        ckpt.import_table(a.setup, a.state, "nope", str(tmp_path / "full.npy"))
    np.testing.assert_array_equal(all_tables(a)["rw"]["table"], good)  # the state as it was


def test_import_table_returns_a_new_state(tmp_path):
    a = trainer(mixed_plan())
    old = all_tables(a)["rw"]["table"]
    np.save(tmp_path / "ones.npy", np.ones_like(old))
    new_state = ckpt.import_table(a.setup, a.state, "rw", str(tmp_path / "ones.npy"))
    np.testing.assert_array_equal(all_tables(a)["rw"]["table"], old)  # the given state
    a.state = new_state
    np.testing.assert_array_equal(all_tables(a)["rw"]["table"], np.ones_like(old))
