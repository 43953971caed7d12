"""`embark_jax.data.criteo_tsv.CriteoTSV`: batches of a TSV file equal the same samples built
as arrays; bad rows are counted; the index cache; a file changed after indexing is refused."""

import os

import pytest

from embark_jax.data.criteo import CriteoTSV, parse_tsv_line
from tests.data.criteo_files import (
    CFG,
    ArraysDataset,
    B,
    arrays_batch,
    assert_same_batch,
    write_tsv,
)


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
