"""`embark_jax.data.criteo_multihot.CriteoMultiHot`: batches of an MLPerf multi-hot directory
equal the arrays; bad values and truncated files name the file, the day and the row."""

import os

import jax
import numpy as np
import pytest

from embark_jax.data.criteo import CriteoMultiHot
from tests.data.criteo_files import (
    CFG,
    ArraysDataset,
    B,
    assert_same_batch,
    multihot_arrays_batch,
    write_multihot,
)


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
