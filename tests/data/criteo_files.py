"""Small Criteo files written for the data tests (a Kaggle/Terabyte TSV file and an MLPerf
DLRMv2 multi-hot directory), their independent parse as arrays, and batch comparisons."""

import dataclasses
import math

import numpy as np

from embark_jax.data.batch import Batch
from embark_jax.data.sparse import PAD, SparseFeatures
from embark_jax.planner import load_preset

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
