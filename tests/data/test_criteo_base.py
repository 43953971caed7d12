"""`embark_jax.data.criteo_base`: what both Criteo readers share (the line parser, the dense
transform, which samples each process reads, held-out splits)."""

import jax
import numpy as np
import pytest

from embark_jax.data.criteo import CriteoTSV
from embark_jax.data.criteo_base import BadRow, dense_transform, parse_tsv_line
from embark_jax.data.sparse import PAD
from tests.data.criteo_files import CFG, B, assert_same_batch


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


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"1\t2", "field_count"),
        (b"2" + b"\t" * 39, "label"),
        (b"0\t1.5" + b"\t" * 38, "dense"),
        (b"0" + b"\t" * 14 + b"g1" + b"\t" * 25, "categorical"),
    ],
)
def test_a_bad_line_is_a_bad_row_with_its_reason(line, reason):
    with pytest.raises(BadRow) as e:
        parse_tsv_line(line)
    assert e.value.reason == reason and str(e.value).startswith(f"{reason}: ")


def test_dense_transform_is_log1p_of_the_positive_part():
    got = dense_transform(np.array([[-5, 0, 1, np.e - 1]]))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [[0, 0, np.log(2), 1]], rtol=1e-6)


def test_split_holds_out_the_last_samples(tsv):
    path, _, _ = tsv
    ds = CriteoTSV(path, CFG, batch_size=B, prefetch=0)
    train, held = ds.split(8)
    assert (train.num_samples, held.num_samples) == (32, 8)
    assert held.sample_indices(0)[:8].tolist() == list(range(32, 40))
    with pytest.raises(ValueError, match="cannot hold out 40 of 40 samples"):
        ds.split(40)
