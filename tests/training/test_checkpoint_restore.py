"""Restores and imports that fail: every mismatch is a one-line
`ValueError` naming the table and the problem, and the live state still steps afterwards
(no "Array has been deleted")."""

import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from embark_jax.ops import optimizers as O
from embark_jax.training import checkpoint as ckpt
from tests.training.test_reliability import assert_tables_equal, copy, tables_of, tiny

ADAGRAD = O.Adagrad(learning_rate=0.1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An Adagrad model after one step, saved: (runner, state, ds, directory)."""
    runner, state, ds = tiny(ADAGRAD)
    state, _ = runner.step(copy(state), ds.batch(0))
    d = str(tmp_path_factory.mktemp("ck"))
    ckpt.save(d, runner.setup, state)
    return runner, state, ds, d


def still_steps(runner, state, ds, before):
    """The live state is unchanged and the next step runs on it (on a copy of it, which
    fails just the same on a deleted buffer, so the module's fixture is never donated)."""
    assert_tables_equal(tables_of(runner, state), before)
    new, r = runner.step(copy(state), ds.batch(1))
    assert np.isfinite(r.loss) and int(new.step) == int(state.step) + 1


def copy_of(d, tmp_path):
    out = str(tmp_path / "copy")
    shutil.copytree(d, out)
    return out


@pytest.mark.parametrize(
    ("opt", "dtype", "pattern"),
    [
        (
            O.SGD(learning_rate=0.1),
            None,
            r"table 'a': checkpoint optimizer Adagrad, configured SGD",
        ),
        (
            O.RowWiseAdagrad(learning_rate=0.1),
            None,
            r"table 'a': checkpoint optimizer Adagrad, configured RowWiseAdagrad",
        ),
        (
            {"a": ADAGRAD, "b": O.Adam(learning_rate=0.1)},
            None,
            r"table 'b': checkpoint optimizer Adagrad, configured Adam",
        ),
        (ADAGRAD, ml_dtypes.bfloat16, r"table 'a': checkpoint dtype float32, configured bfloat16"),
    ],
    ids=["adagrad-into-sgd", "adagrad-into-rowwise", "later-table-adam", "f32-into-bf16"],
)
def test_restore_mismatch_is_a_clear_error_and_the_live_state_survives(saved, opt, dtype, pattern):
    """Adagrad -> SGD (slots would be dropped), f32 -> bf16 (tables would be converted) and
    Adagrad -> row-wise Adagrad (slot shapes differ) are each a clear error, never silent."""
    _, _, ds, d = saved
    runner, state, _ = tiny(opt, dtype=dtype or np.float32, seed=3)
    before = tables_of(runner, state)
    with pytest.raises(ValueError, match=pattern):
        ckpt.restore(d, runner.setup)
    still_steps(runner, state, ds, before)


def test_a_model_with_one_table_fewer_or_another_name(saved):
    """The error names the tables that differ, not a dense-parameter shape."""
    _, _, ds, d = saved
    runner, state, _ = tiny(ADAGRAD, names=("a", "c"))
    with pytest.raises(ValueError, match=r"has tables \['b'\] that the model does not configure"):
        ckpt.restore(d, runner.setup)
    still_steps(runner, state, ds, tables_of(runner, state))


def test_slot_shape_mismatch_on_the_later_table(saved, tmp_path):
    """The metadata claims row-wise Adagrad for table 'b' but its files hold a [V, d]
    accumulator: the restore stops at 'b' (after 'a' was read) and the live state lives."""
    _, _, ds, d = saved
    d = copy_of(d, tmp_path)
    path = os.path.join(d, "step_00000001", "meta.json")
    meta = json.load(open(path))
    meta["tables"]["b"]["optimizer"] = "RowWiseAdagrad"
    json.dump(meta, open(path, "w"))
    runner, state, _ = tiny({"a": ADAGRAD, "b": O.RowWiseAdagrad(learning_rate=0.1)}, seed=4)
    state, _ = runner.step(state, ds.batch(0))
    before = tables_of(runner, state)
    with pytest.raises(ValueError, match=r"table 'b': slot 'accumulator' has shape \(9, 4\)"):
        ckpt.restore(d, runner.setup)
    still_steps(runner, state, ds, before)


BAD_META = {  # field -> value written into meta.json, and the error's tail
    "step-text": ("step", "three", r"step must be an integer in \[0, 2147483647\], got 'three'"),
    "step-null": ("step", None, r"step must be an integer in \[0, 2147483647\], got None"),
    "step-float": ("step", 3.7, r"step must be an integer in \[0, 2147483647\], got 3.7"),
    "step-negative": ("step", -4, r"step must be an integer in \[0, 2147483647\], got -4"),
    "step-bool": ("step", True, r"step must be an integer in \[0, 2147483647\], got True"),
    "step-other": ("step", 2, r"its meta.json says step 2, not 1"),
    "position": ("data_position", "x", r"data_position must be an integer in \[0, \d+\], got 'x'"),
    "dense": ("dense", "x", r"dense must be an object, got 'x'"),
    "plan-text": ("plan", "x", r"plan must be an object, got 'x'"),
    "plan-empty": ("plan", {}, r"meta.json: plan: "),
    "tables": ("tables", [], r"tables must be an object, got \[\]"),
    "step-int32": ("step", 2**31, r"step must be an integer in \[0, 2147483647\], got 2147483648"),
    "table-dir": ("tables", "dir", r"table 'a': its dir in .* must be a string, got None"),
    "table-step": ("tables", 7, r"table 'a': .* records step 7, the checkpoint 1"),
    "table-step-bool": ("tables", True, r"table 'a': .* records step True, the checkpoint 1"),
    "table-step-float": ("tables", 1.0, r"table 'a': .* records step 1.0, the checkpoint 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_META))
def test_a_hand_edited_meta_json_is_a_one_line_error(saved, tmp_path, case):
    """A bad field is a one-line error, not a bare int() or AttributeError, and a step of
    3.7 or -4 is refused, not restored at."""
    key, value, pattern = BAD_META[case]
    runner, state, ds, d = saved
    before = tables_of(runner, state)
    d = copy_of(d, tmp_path)
    path = os.path.join(d, "step_00000001", "meta.json")
    meta = json.load(open(path))
    if case == "table-dir":
        meta["tables"]["a"]["dir"] = None
    elif case.startswith("table-step"):
        meta["tables"]["a"]["step"] = value
    else:
        meta[key] = value
    json.dump(meta, open(path, "w"))
    with pytest.raises(ValueError, match=pattern) as e:
        ckpt.restore(d, runner.setup)
    assert "\n" not in str(e.value)
    still_steps(runner, state, ds, before)


def _unreadable_table_b(saved, tmp_path):
    runner, state, ds, d = saved
    d = copy_of(d, tmp_path)
    return runner, state, ds, d, os.path.join(d, "step_00000001", "tables", "b")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 directory anyway")
def test_an_unreadable_table_directory_says_permission_denied(saved, tmp_path):
    """The error says permission denied, not Orbax's 'Metadata file (named _METADATA) does
    not exist'."""
    runner, state, ds, d, table_dir = _unreadable_table_b(saved, tmp_path)
    before = tables_of(runner, state)
    os.chmod(table_dir, 0)
    try:
        with pytest.raises(ValueError, match=r"cannot read table 'b' .*: permission denied"):
            ckpt.restore(d, runner.setup)
    finally:
        os.chmod(table_dir, 0o755)
    still_steps(runner, state, ds, before)


def test_the_permission_check_names_the_table(saved, tmp_path, monkeypatch):
    """The same path where the tests run as root (which may read anything): os.access is
    made to refuse table 'b''s directory."""
    runner, _, _, d, table_dir = _unreadable_table_b(saved, tmp_path)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: real(p, m) and p != table_dir)
    with pytest.raises(ValueError, match=r"cannot read table 'b' .*: permission denied on "):
        ckpt.restore(d, runner.setup)


def test_a_meta_json_that_is_not_utf8_names_the_file(saved, tmp_path):
    runner, _, _, d = saved
    d = copy_of(d, tmp_path)
    with open(os.path.join(d, "step_00000001", "meta.json"), "wb") as f:
        f.write(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"meta.json is not valid JSON"):
        ckpt.restore(d, runner.setup)


_SAVE_INTO_A_FILE = """
import os, sys, tempfile
import jax
jax.config.update("jax_num_cpu_devices", 8)
from embark_jax.ops import optimizers as O
from embark_jax.training import checkpoint as ckpt
from tests.training.test_reliability import tiny
runner, state, _ = tiny(O.Adagrad(learning_rate=0.1))
path = os.path.join(tempfile.mkdtemp(), "afile")
open(path, "w").write("x")
try:
    ckpt.save(path, runner.setup, state)
except OSError as e:
    print("refused:", type(e).__name__)
"""


def test_a_save_into_a_file_fails_at_once_and_the_process_exits(tmp_path):
    """A save into a file is refused at once and the process exits (Orbax's threads, once
    started on such a save, keep a process alive for minutes at exit, waiting for the
    directory)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-c", _SAVE_INTO_A_FILE],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:1] == ["refused:"], r.stdout


def test_one_damaged_table_keeps_the_live_state(saved, tmp_path):
    _, _, ds, d = saved
    d = copy_of(d, tmp_path)
    table_dir = os.path.join(d, "step_00000001", "tables", "b")
    for root, _, files in os.walk(table_dir):
        for f in files:
            if root != table_dir:  # the data files, not the Orbax metadata
                open(os.path.join(root, f), "wb").close()
    runner, state, _ = tiny(ADAGRAD, seed=5)
    state, _ = runner.step(state, ds.batch(0))
    before = tables_of(runner, state)
    with pytest.raises(ValueError, match=r"table 'b'"):
        ckpt.restore(d, runner.setup)
    still_steps(runner, state, ds, before)


def test_a_table_directory_copied_from_another_step_is_detected(saved, tmp_path):
    """Restoring step 2 with table 'a' copied from step 1 is an error, not a silent mix."""
    runner, state, ds, d = saved
    d = copy_of(d, tmp_path)
    state2, _ = runner.step(copy(state), ds.batch(1))
    ckpt.save(d, runner.setup, state2)
    one, two = (os.path.join(d, f"step_0000000{i}", "tables", "a") for i in (1, 2))
    shutil.rmtree(two)
    shutil.copytree(one, two)
    with pytest.raises(ValueError, match=r"table 'a': .* does not match the fingerprint .* 2"):
        ckpt.restore(d, runner.setup)
    still_steps(runner, state2, ds, tables_of(runner, state2))


def _npz(tmp_path, **arrays):
    path = str(tmp_path / "t.npz")
    np.savez(path, **arrays)
    return path


GOOD = np.full((64, 4), 0.5, np.float32)
BAD_IMPORTS = {
    "nan": (dict(table=np.where(np.eye(64, 4) > 0, np.nan, GOOD)), r"'a': table holds NaN"),
    "inf": (dict(table=np.where(np.eye(64, 4) > 0, -np.inf, GOOD)), r"'a': table holds NaN or inf"),
    "f64-overflow": (
        dict(table=np.full((64, 4), 1e39, np.float64)),
        r"'a': table has values beyond the float32 range",
    ),
    "negative-accumulator": (
        dict(table=GOOD, slot_accumulator=-np.ones((64, 4), np.float32)),
        r"'a': slot 'accumulator' has negative values",
    ),
    "unknown-slot": (
        dict(table=GOOD, slot_momentum=np.ones((64, 4), np.float32)),
        r"'a': unknown slots \['momentum'\] for optimizer Adagrad",
    ),
    "slot-shape": (
        dict(table=GOOD, slot_accumulator=np.ones((64,), np.float32)),
        r"'a': slot 'accumulator' has shape \(64,\), expected \(64, 4\)",
    ),
    "strings": (dict(table=np.full((64, 4), "x")), r"'a': table has non-numeric dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMPORTS))
def test_import_table_rejects_bad_values_and_keeps_the_state(saved, tmp_path, case):
    """NaN, inf, float64 overflow, negative accumulators and unknown slots are refused, and a
    wrong slot shape leaves the live state intact."""
    runner, state, ds, _ = saved
    arrays, pattern = BAD_IMPORTS[case]
    before = tables_of(runner, state)
    with pytest.raises(ValueError, match=pattern):
        ckpt.import_table(runner.setup, state, "a", _npz(tmp_path, **arrays))
    still_steps(runner, state, ds, before)


def test_import_table_accepts_float64_in_range(saved, tmp_path):
    runner, state, _, _ = saved
    path = _npz(tmp_path, table=GOOD.astype(np.float64))
    new = ckpt.import_table(runner.setup, state, "a", path)
    np.testing.assert_array_equal(tables_of(runner, new)["a"], GOOD)
