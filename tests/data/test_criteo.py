"""Criteo data (`embark_jax.data.criteo`) end to end, on the small files of
`tests.data.criteo_files`: dynamic-table columns carry raw 64-bit ids, 3 training steps from
the files equal 3 steps from the arrays, loss by loss, and the CLI trains on both formats and
rejects a bad --data with one error line. Each reader's own tests: `test_criteo_tsv`,
`test_criteo_multihot`, `test_criteo_base`."""

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from embark_jax.core.dynamic import DynamicConfig, DynamicFeatureConfig, DynamicTableConfig
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.criteo import CriteoMultiHot, CriteoTSV
from embark_jax.ops import optimizers as O
from embark_jax.training import state as train_state
from embark_jax.training.loop import fit
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import StepRunner
from tests.data.criteo_files import (
    CFG,
    FEATURES,
    HOTNESS,
    ArraysDataset,
    B,
    arrays_batch,
    assert_same_batch,
    multihot_arrays_batch,
    write_multihot,
)

# --- dynamic tables: raw ids as 64-bit keys ---------------------------------------------------

DYN_COLUMNS = (0, 3, 25)  # a hotness-3 column, a hotness-2 one and the last


def _dynamic_split():
    """(the fixed config without DYN_COLUMNS' features, their DynamicConfig)."""
    names = {FEATURES[j] for j in DYN_COLUMNS}
    fixed = EmbeddingConfig.create(
        [t for t in CFG.tables if f"f_{t.name}" not in names],
        [f for f in CFG.features if f.name not in names],
    )
    dyn = DynamicConfig(
        tuple(
            DynamicTableConfig(name=CFG.features[j].table, dim=8, capacity=64) for j in DYN_COLUMNS
        ),
        tuple(
            DynamicFeatureConfig(
                name=FEATURES[j], table=CFG.features[j].table, max_hotness=HOTNESS[j]
            )
            for j in DYN_COLUMNS
        ),
    )
    return fixed, dyn


def _words(raw_columns) -> np.ndarray:
    """[k, H] raw ids (-1: empty) as [k, H, 2] uint32 words, low word first."""
    u = np.asarray(raw_columns, np.int64).view(np.uint64)
    return np.stack([u & np.uint64(0xFFFFFFFF), u >> np.uint64(32)], axis=-1).astype(np.uint32)


def test_dynamic_columns_carry_raw_ids_and_fixed_ones_are_unchanged(tsv, multihot):
    fixed, dyn = _dynamic_split()
    path, samples, _ = tsv
    directory, data = multihot
    readers = [
        (
            CriteoTSV(path, fixed, batch_size=B, dynamic=dyn, columns=FEATURES),
            CriteoTSV(path, CFG, batch_size=B),
        ),
        (
            CriteoMultiHot(directory, fixed, batch_size=B, dynamic=dyn, columns=FEATURES),
            CriteoMultiHot(directory, CFG, batch_size=B),
        ),
    ]
    for k, (ds, plain) in enumerate(readers):
        got, want = ds.batch(1), plain.batch(1)
        rows = [(B + i) % ds.num_samples for i in range(B)]
        assert sorted(got.dynamic) == sorted(FEATURES[j] for j in DYN_COLUMNS)
        for j in DYN_COLUMNS:
            raw = np.full((B, HOTNESS[j]), -1, np.int64)
            if k == 0:  # TSV: the hex value's 64 bits (no modulo), one id a bag
                raw[:, 0] = [np.uint64(samples[r][3][j]).view(np.int64) for r in rows]
            else:  # multi-hot: the file's ids, the first max_hotness of each bag
                src = data[2][j][rows][:, : HOTNESS[j]]
                raw[:, : src.shape[1]] = src
            np.testing.assert_array_equal(
                got.dynamic[FEATURES[j]], _words(raw), err_msg=FEATURES[j]
            )
        assert sorted(got.sparse.ids) == sorted(f.name for f in fixed.features)
        for name in got.sparse.ids:
            np.testing.assert_array_equal(got.sparse.ids[name], want.sparse.ids[name])
        np.testing.assert_array_equal(got.labels, want.labels)
        got.validate(fixed, num_devices=1, num_dense=13, dynamic=dyn)
        ds.close()
        plain.close()
    assert any(s[3][j] >= 2**32 for s in samples for j in DYN_COLUMNS)  # wide ids were read


def test_dynamic_columns_other_process_rows_are_padding_and_bad_columns_refused(tsv):
    fixed, dyn = _dynamic_split()
    path, _, _ = tsv
    ds = CriteoTSV(
        path, fixed, batch_size=B, dynamic=dyn, columns=FEATURES, process_index=1, process_count=2
    )
    glob = ds.batch(0)
    for x in glob.dynamic.values():
        assert x.dtype == np.uint32 and np.all(x[: B // 2] == 0xFFFFFFFF)
        assert not np.all(x[B // 2 :] == 0xFFFFFFFF)
    glob.validate(fixed, num_devices=2, num_dense=13, dynamic=dyn)
    ds.close()
    with pytest.raises(ValueError, match="must name each of the model's features"):
        CriteoTSV(path, fixed, batch_size=B, dynamic=dyn, columns=[*FEATURES[:-1], FEATURES[0]])
    with pytest.raises(ValueError, match="26 categorical features but the model has 23"):
        CriteoTSV(path, fixed, batch_size=B)


# --- training from the files equals training from the arrays ----------------------------------


@pytest.fixture(scope="module")
def runner_and_state():
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=8),
        batch_size=B,
        tables=tuple(
            TablePlan(
                name=t.name,
                cluster="rb" if i == 0 else "dp",
                row_shards=8 if i == 0 else 1,
                column_shards=1,
                devices=(tuple(range(8)),),
            )
            for i, t in enumerate(CFG.tables)
        ),
    )
    setup, state = train_state.create(
        CFG,
        plan,
        dense=DenseConfig(kind="dlrm", bottom=(16, 8), top=(16, 1)),
        sparse_optimizer=O.Adagrad(learning_rate=0.1),
        dense_optimizer=optax.adam(1e-2),
        seed=0,
    )
    return StepRunner(setup), state


def _three_steps(runner, state, ds):
    copy = jax.tree.map(jnp.copy, state)  # the runner may donate its input
    _, summary = fit(runner, copy, ds, 3)
    return summary.losses


def test_three_steps_from_files_equal_three_steps_from_arrays(tsv, multihot, runner_and_state):
    runner, state = runner_and_state
    path, samples, _ = tsv
    from_file = _three_steps(runner, state, CriteoTSV(path, CFG, batch_size=B))
    from_arrays = _three_steps(
        runner, state, ArraysDataset(lambda rows: arrays_batch(samples, rows), len(samples))
    )
    assert len(from_file) == 3 and all(np.isfinite(from_file))
    assert from_file == from_arrays  # identical batches: identical losses, bit for bit
    directory, data = multihot
    from_file = _three_steps(runner, state, CriteoMultiHot(directory, CFG, batch_size=B))
    from_arrays = _three_steps(
        runner, state, ArraysDataset(lambda rows: multihot_arrays_batch(data, rows), 33)
    )
    assert from_file == from_arrays  # the same arrays: bit for bit


# --- the CLI -----------------------------------------------------------------------------------


def _cli(args, timeout=240):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return subprocess.run(
        [sys.executable, "-m", "embark_jax", "train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize(
    "data, message",
    [
        ("criteo", "is not synthetic, criteo-tsv:PATH or criteo-multihot:DIR"),
        ("criteo-tsv:/nonexistent/file.txt", "is not a file"),
        ("criteo-multihot:/nonexistent", "is not a directory"),
    ],
)
def test_cli_bad_data_is_one_error_line(data, message):
    r = _cli(["--data", data, "--steps", "1"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and message in lines[0], r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("where", ["first batch", "later batch"])
def test_cli_bad_multihot_value_is_one_error_line(tmp_path, where):
    """A label of 2 in the first batch fails before anything is written; a NaN dense value
    met at step 2 stops training with the same kind of line."""
    data = tmp_path / "data"
    data.mkdir()
    write_multihot(data)
    if where == "first batch":
        labels = np.load(data / "day_0_labels.npy")
        labels[3, 0] = 2
        np.save(data / "day_0_labels.npy", labels)
        needle = f"{data}/day_0_labels.npy row 3: label 2 is not 0 or 1"
    else:  # sample 16 is first read by batch 1 (the 17 training samples wrap)
        dense = np.load(data / "day_0_dense.npy")
        dense[16, 4] = np.nan
        np.save(data / "day_0_dense.npy", dense)
        needle = f"{data}/day_0_dense.npy row 16: dense feature 4 is nan"
    out = tmp_path / "out"
    r = _cli(
        [
            *("--data", f"criteo-multihot:{data}", "--model", "dcnv2-mini"),
            *("--max-vocab", "50", "--max-hotness", "2", "--batch-size", "16", "--steps", "3"),
            *("--eval-batches", "1", "--devices", "1", "--baseline", "dp"),
            *("--topology", "h200", "--out", str(out / "m.json")),
            *("--plan-out", str(out / "plan.json"), "--log-dir", str(out / "logs")),
            *("--checkpoint-dir", str(out / "ckpt")),
        ]
    )
    text = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in text, text
    errors = [line for line in text.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], text
    if where == "first batch":
        assert "batch 0" in errors[0] and not out.exists(), text  # nothing written
    else:
        assert "batch 1 (step 2)" in errors[0] and not (out / "m.json").exists(), text


@pytest.mark.slow
def test_cli_trains_on_tsv(tsv, tmp_path):
    path, _, _ = tsv
    out = tmp_path / "m.json"
    data = f"criteo-tsv:{path}"
    r = _cli(
        [
            *("--data", data, "--model", "dcnv2-mini", "--max-vocab", "50"),
            *("--max-hotness", "2", "--batch-size", "16", "--steps", "2"),
            *("--eval-batches", "1", "--devices", "1", "--baseline", "dp"),
            *("--topology", "h200", "--out", str(out)),
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads(out.read_text())
    assert m["data"] == data and len(m["losses"]) == 2 and np.isfinite(m["eval_logloss"])
    assert m["bad_rows"]["field_count"] == 3 and "6 bad (field_count 3" in r.stdout
    assert "evaluating on the last 16 samples" in r.stdout


def test_cli_data_wiring_for_multihot(multihot):
    """What `train --data criteo-multihot:DIR` builds (the training itself is the test
    above with the same code path and the 3-step test)."""
    from embark_jax.cli import errors
    from embark_jax.cli import train as train_cli
    from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig

    directory, data = multihot
    args = argparse.Namespace(
        data=train_cli.data_source(f"criteo-multihot:{directory}"),
        batch_size=B,
        eval_batches=1,
        seed=0,
    )
    said = []
    ds, evals = train_cli._datasets(args, CFG, said.append)
    assert isinstance(ds, CriteoMultiHot) and ds.num_samples == 33 - B
    make = ArraysDataset(lambda rows: multihot_arrays_batch(data, rows), 33)
    assert_same_batch(ds.batch(0), make.batch(0))
    assert_same_batch(evals[0], multihot_arrays_batch(data, list(range(17, 33))))
    assert "33 samples" in said[0] and "no bad rows" in said[0]
    small = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=5, dim=4)], [FeatureConfig(name="f", table="t")]
    )
    with pytest.raises(errors.CLIError, match="26 categorical features but the model has 1"):
        train_cli._datasets(args, small, said.append)
