"""Criteo data (`embark_jax.data.criteo`): a small TSV file in the Kaggle/Terabyte format and a
small MLPerf DLRMv2 multi-hot directory, both written here. The readers' batches equal the
same samples built as arrays (`Batch` / `SparseFeatures` directly, from an independent parse
of the file); 3 training steps from the files equal 3 steps from the arrays, loss by loss;
bad rows are skipped whole and counted; 2 processes each read half of every batch; batches
are the same after a restart and with prefetching out of order; the CLI trains on both and
rejects a bad --data with one error line."""

import argparse
import dataclasses
import json
import math
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
from embark_jax.data.batch import Batch
from embark_jax.data.criteo import CriteoMultiHot, CriteoTSV, parse_tsv_line
from embark_jax.data.sparse import PAD, SparseFeatures
from embark_jax.ops import optimizers as O
from embark_jax.planner import load_preset
from embark_jax.training import state as train_state
from embark_jax.training.loop import fit
from embark_jax.training.models import DenseConfig
from embark_jax.training.runner import StepRunner

VOCAB, HOT, B = 50, 3, 16
SPEC = load_preset("dcnv2-mini")
SPEC = dataclasses.replace(
    SPEC,
    tables=tuple(
        dataclasses.replace(
            t, vocab_size=min(t.vocab_size, VOCAB), hotness=min(t.hotness, HOT), dim=8
        )
        for t in SPEC.tables
    ),
)
CFG = SPEC.embedding_config()
FEATURES = [f.name for f in CFG.features]
VOCABS = [CFG.table_by_name[f.table].vocab_size for f in CFG.features]
HOTNESS = [f.max_hotness for f in CFG.features]


# --- a TSV file and its independent parse ----------------------------------------------------


def _hex_id(rng) -> str:
    """A categorical value as Criteo writes it (8 hex digits), or, one time in three, a wider
    one of up to 16 digits (hashed ids of 64 bits: their high bits decide the row too)."""
    if rng.random() < 1 / 3:
        return f"{int(rng.integers(2**32, 2**64, dtype=np.uint64)):x}"
    return f"{int(rng.integers(0, 2**32)):08x}"


def _good_line(rng) -> tuple[str, tuple]:
    label = int(rng.integers(0, 2))
    dense_raw = [None if rng.random() < 0.15 else int(rng.integers(-3, 5000)) for _ in range(13)]
    cats_raw = [None if rng.random() < 0.1 else _hex_id(rng) for _ in range(26)]
    text = "\t".join(
        [str(label)]
        + ["" if x is None else str(x) for x in dense_raw]
        + ["" if x is None else (x.upper() if rng.random() < 0.1 else x) for x in cats_raw]
    )
    dense = [math.log(1 + max(x, 0)) if x is not None else 0.0 for x in dense_raw]
    raw = [int(c, 16) if c is not None else 0 for c in cats_raw]
    ids = [r % v for r, v in zip(raw, VOCABS, strict=True)]
    return text, (label, dense, ids, raw)


def write_tsv(path, n_good=40, seed=0):
    """`n_good` samples with bad lines among them; returns (samples, bad line numbers by
    reason)."""
    rng = np.random.default_rng(seed)
    lines, samples = [], []
    for _ in range(n_good):
        text, sample = _good_line(rng)
        lines.append(text)
        samples.append(sample)
    good = lines[0].split("\t")
    bad = {
        "field_count": [
            "\t".join(good[:-1]),  # a missing field: never re-aligned
            "\t".join([*good, "0"]),  # one field too many
            "",  # blank line
        ],
        "categorical": ["\t".join([*good[:20], "xyz123", *good[21:]])],
        "dense": ["\t".join([*good[:3], "1.5", *good[4:]])],
        "label": ["\t".join(["2", *good[1:]])],
    }
    where = {}
    for k, (reason, texts) in enumerate(bad.items()):
        for t in texts:
            at = 3 + 5 * k + len(where.get(reason, []))
            lines.insert(at, t)
    for reason, texts in bad.items():  # line numbers (1-based) after all insertions
        where[reason] = sorted(i + 1 for i, line in enumerate(lines) if line in texts)
    path.write_text("\n".join(lines) + "\n")
    return samples, where


def arrays_batch(samples, rows) -> Batch:
    """The batch of `samples[rows]` built directly as arrays."""
    labels = np.array([samples[r][0] for r in rows], np.float32)
    dense = np.array([samples[r][1] for r in rows], np.float32)
    ids = {}
    for j, name in enumerate(FEATURES):
        x = np.full((len(rows), HOTNESS[j]), PAD, np.int64)
        x[:, 0] = [samples[r][2][j] for r in rows]
        ids[name] = x
    return Batch(SparseFeatures.from_dense(ids, config=CFG), dense, labels)


class ArraysDataset:
    def __init__(self, make, n):
        self.make, self.n, self.batch_size = make, n, B

    def batch(self, step):
        return self.make([(step * B + i) % self.n for i in range(B)])


def assert_same_batch(a: Batch, b: Batch):
    np.testing.assert_array_equal(np.asarray(a.labels), np.asarray(b.labels))
    np.testing.assert_array_equal(np.asarray(a.dense), np.asarray(b.dense))
    assert np.asarray(a.dense).dtype == np.asarray(b.dense).dtype == np.float32
    assert sorted(a.sparse.ids) == sorted(b.sparse.ids)
    for name in a.sparse.ids:
        np.testing.assert_array_equal(a.sparse.ids[name], b.sparse.ids[name], err_msg=name)
        np.testing.assert_array_equal(a.sparse.lengths[name], b.sparse.lengths[name])


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    path = tmp_path_factory.mktemp("criteo") / "train.txt"
    samples, where = write_tsv(path)
    return path, samples, where


def test_tsv_batches_equal_the_arrays_and_bad_rows_are_counted(tsv):
    path, samples, where = tsv
    ds = CriteoTSV(path, CFG, batch_size=B)
    assert ds.num_samples == len(samples) == 40
    assert ds.bad_rows == {r: len(v) for r, v in where.items()}
    assert {w for w, _ in ds.bad_examples} <= {w for v in where.values() for w in v}
    assert "6 bad" in ds.describe_bad_rows() and "field_count 3" in ds.describe_bad_rows()
    make = ArraysDataset(lambda rows: arrays_batch(samples, rows), len(samples))
    for step in (0, 1, 2, 7, 3):  # 2 wraps around the end; out of order defeats prefetch
        assert_same_batch(ds.batch(step), make.batch(step))
    again = CriteoTSV(path, CFG, batch_size=B, prefetch=0)  # a restart
    assert_same_batch(again.batch(7), ds.batch(7))
    ds.close()


def test_tsv_index_cache_and_line_parser(tsv, tmp_path):
    path, _, _ = tsv
    cache = tmp_path / "index.npz"
    first = CriteoTSV(path, CFG, batch_size=B, index_cache=str(cache))
    assert cache.exists()
    second = CriteoTSV(path, CFG, batch_size=B, index_cache=str(cache))
    assert second.bad_rows == first.bad_rows and second.bad_examples == first.bad_examples
    assert_same_batch(second.batch(1), first.batch(1))
    label, dense, cats = parse_tsv_line(b"1\t5\t\t-2" + b"\t" * 11 + b"a0" + b"\t" * 25 + b"\n")
    assert (label, dense[:3], cats[:2]) == (1, [5, 0, -2], [0xA0, 0])
    wide = b"0" + b"\t" * 14 + b"fedcba9876543210" + b"\t" * 25 + b"\n"
    assert parse_tsv_line(wide)[2][0] == 0xFEDCBA9876543210  # all 64 bits, none dropped


def test_two_processes_each_read_half_of_every_batch(tsv):
    path, _, _ = tsv
    full = CriteoTSV(path, CFG, batch_size=B, prefetch=0)
    parts = [CriteoTSV(path, CFG, batch_size=B, process_index=p, process_count=2) for p in (0, 1)]
    for step in (0, 2):
        want = full.batch(step)
        for p, ds in enumerate(parts):
            rows = slice(p * B // 2, (p + 1) * B // 2)
            assert list(ds.sample_indices(step)) == [(step * B + i) % 40 for i in range(B)][rows]
            local = ds.local_batch(step)
            sliced = jax.tree.map(lambda x, rows=rows: np.asarray(x)[rows], want)
            assert_same_batch(local, sliced)
            glob = ds.batch(step)  # global shape; other rows empty, all labels right
            np.testing.assert_array_equal(glob.labels, want.labels)
            own = jax.tree.map(lambda x, rows=rows: np.asarray(x)[rows], glob)
            assert_same_batch(own, sliced)
            other = slice(B // 2, B) if p == 0 else slice(0, B // 2)
            assert all(np.all(np.asarray(x)[other] == PAD) for x in glob.sparse.ids.values())
    with pytest.raises(ValueError, match="multiple of the 3 processes"):
        CriteoTSV(path, CFG, batch_size=B, process_count=3)


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


# --- the multi-hot layout ----------------------------------------------------------------------

FILE_HOTNESS = [1, 2, 3, 5] * 6 + [1, 4]  # some wider than the model's HOT (kept: first HOT)


def write_multihot(directory, days=(0, 1), n=(20, 13), seed=1):
    """MLPerf-layout days; day 1's sparse archive is unpacked into a directory, day 0's is an
    `np.savez` archive. Returns the concatenated (labels, dense, sparse list) arrays."""
    rng = np.random.default_rng(seed)
    all_l, all_d, all_s = [], [], [[] for _ in range(26)]
    for day, rows in zip(days, n, strict=True):
        labels = rng.integers(0, 2, size=(rows, 1)).astype(np.int32)
        dense = rng.normal(size=(rows, 13)).astype(np.float32)
        sparse = {
            str(j): rng.integers(0, 40_000_000, size=(rows, h)).astype(np.int32)
            for j, h in enumerate(FILE_HOTNESS)
        }
        sparse["5"] = sparse["5"][:, 0]  # a 1-D member (hotness 1)
        np.save(directory / f"day_{day}_labels.npy", labels)
        np.save(directory / f"day_{day}_dense.npy", dense)
        if day == 0:
            np.savez(directory / f"day_{day}_sparse_multi_hot.npz", **sparse)
        else:
            unpacked = directory / f"day_{day}_sparse_multi_hot_unpacked"
            unpacked.mkdir()
            for k, v in sparse.items():
                np.save(unpacked / f"{k}.npy", v)
        all_l.append(labels[:, 0])
        all_d.append(dense)
        for j in range(26):
            all_s[j].append(sparse[str(j)].reshape(rows, -1))
    return (
        np.concatenate(all_l),
        np.concatenate(all_d),
        [np.concatenate(s) for s in all_s],
    )


def multihot_arrays_batch(data, rows) -> Batch:
    labels, dense, sparse = data
    ids = {}
    for j, name in enumerate(FEATURES):
        x = np.full((len(rows), HOTNESS[j]), PAD, np.int64)
        src = sparse[j][rows][:, : HOTNESS[j]].astype(np.int64) % VOCABS[j]
        x[:, : src.shape[1]] = src
        ids[name] = x
    return Batch(
        SparseFeatures.from_dense(ids, config=CFG),
        dense[rows].astype(np.float32),
        labels[rows].astype(np.float32),
    )


@pytest.fixture(scope="module")
def multihot(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multihot")
    return directory, write_multihot(directory)


def test_multihot_batches_equal_the_arrays(multihot, tmp_path):
    directory, data = multihot
    ds = CriteoMultiHot(directory, CFG, batch_size=B)
    assert ds.days == [0, 1] and ds.num_samples == 33
    assert isinstance(ds._sparse[0][0], np.memmap)  # stored archive members are mapped
    make = ArraysDataset(lambda rows: multihot_arrays_batch(data, rows), 33)
    for step in (0, 1, 2, 5):  # batch 1 spans both days, 2 wraps around
        assert_same_batch(ds.batch(step), make.batch(step))
    halves = [
        CriteoMultiHot(directory, CFG, batch_size=B, process_index=p, process_count=2)
        for p in (0, 1)
    ]
    joined = [h.local_batch(1) for h in halves]
    both = jax.tree.map(lambda a, b: np.concatenate([a, b]), *joined)
    assert_same_batch(both, make.batch(1))
    # a compressed archive is read whole; a broken directory is a ValueError naming the file
    (tmp_path / "day_3_labels.npy").write_bytes((directory / "day_0_labels.npy").read_bytes())
    (tmp_path / "day_3_dense.npy").write_bytes((directory / "day_0_dense.npy").read_bytes())
    with np.load(directory / "day_0_sparse_multi_hot.npz") as z:
        np.savez_compressed(tmp_path / "day_3_sparse_multi_hot.npz", **dict(z))
    packed = CriteoMultiHot(tmp_path, CFG, batch_size=B)
    assert_same_batch(packed.batch(0), make.batch(0))
    os.remove(tmp_path / "day_3_dense.npy")
    with pytest.raises(ValueError, match="day 3"):
        CriteoMultiHot(tmp_path, CFG, batch_size=B)


# --- training from the files equals training from the arrays ----------------------------------


def test_multihot_bad_labels_and_dense_values_name_the_file_row_and_value(tmp_path):
    from embark_jax.data.batch import DataError

    write_multihot(tmp_path)
    labels = np.load(tmp_path / "day_0_labels.npy")
    labels[3, 0] = 2
    np.save(tmp_path / "day_0_labels.npy", labels)
    dense = np.load(tmp_path / "day_1_dense.npy")
    dense[2, 7] = np.nan
    np.save(tmp_path / "day_1_dense.npy", dense)
    ds = CriteoMultiHot(tmp_path, CFG, batch_size=B, prefetch=0)
    day0, day1 = (str(tmp_path / f"day_{d}_{k}.npy") for d, k in ((0, "labels"), (1, "dense")))
    with pytest.raises(
        DataError, match=rf"^criteo-multihot {tmp_path} day 0: {day0} row 3: label 2 is not 0 or 1$"
    ):
        ds.batch(0)
    with pytest.raises(  # sample 22 is day 1's row 2
        DataError, match=rf"day 1: {day1} row 2: dense feature 7 is nan, not a finite float32"
    ):
        ds.batch(1)
    other = CriteoMultiHot(tmp_path, CFG, batch_size=B, process_index=1, process_count=2)
    with pytest.raises(DataError, match=r"row 3: label 2"):  # labels of the others' rows too
        other.batch(0)


@pytest.mark.parametrize(
    ("victim", "message"),
    [
        ("day_1_labels.npy", r"day 1 labels: {dir}/day_1_labels.npy: shorter than its header"),
        ("day_1_dense.npy", r"day 1 dense features: {dir}/day_1_dense.npy: shorter than its"),
        (
            "day_1_sparse_multi_hot_unpacked/7.npy",
            r"day 1 sparse feature 7: {dir}/day_1_sparse_multi_hot_unpacked/7.npy: shorter",
        ),
        ("day_0_sparse_multi_hot.npz", r"day 0: {dir}/day_0_sparse_multi_hot.npz: "),
    ],
)
def test_multihot_truncated_file_names_the_file_day_and_feature(tmp_path, victim, message):
    write_multihot(tmp_path)
    path = tmp_path / victim
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(ValueError, match=message.format(dir=tmp_path)):
        CriteoMultiHot(tmp_path, CFG, batch_size=B)


def test_tsv_changed_after_indexing_names_the_file_and_line(tmp_path):
    from embark_jax.data.batch import DataError

    path = tmp_path / "train.txt"
    write_tsv(path)
    ds = CriteoTSV(path, CFG, batch_size=B, prefetch=0)
    lines = path.read_bytes().split(b"\n")
    stat = os.stat(path)
    # line 2 (sample 1) becomes a bad line of the same length, the mtime kept: only the
    # parse can tell
    lines[1] = b"7" + lines[1][1:]
    path.write_bytes(b"\n".join(lines))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(
        DataError,
        match=rf"^criteo-tsv {path}: line 2 is no longer a valid sample \(label: label b'7'\): "
        "the file changed after it was indexed; restart to index it again$",
    ):
        ds.batch(0)
    with open(path, "ab") as fh:  # appended to: size and mtime change
        fh.write(b"0\t1\n")
    with pytest.raises(
        DataError, match=rf"^criteo-tsv {path}: the file changed after it was indexed \(size"
    ):
        ds.batch(1)


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
