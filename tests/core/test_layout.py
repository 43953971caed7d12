"""`embark_jax.core.layout.ShardLayout`: modulo row ownership and column slices."""

import numpy as np
import pytest

from embark_jax.core.layout import ShardLayout
from embark_jax.core.plan import Cluster, TablePlan
from embark_jax.core.specs import TableConfig


def test_ids_map_to_shards_and_back():
    lay = ShardLayout(vocab_size=10, dim=4, row_shards=3)
    ids = np.arange(10)
    np.testing.assert_array_equal(lay.row_shard(ids), ids % 3)
    np.testing.assert_array_equal(lay.global_id(lay.row_shard(ids), lay.local_row(ids)), ids)
    assert [lay.shard_rows(j) for j in range(3)] == [4, 3, 3]
    assert ids[lay.ids_of(1)].tolist() == [1, 4, 7]


def test_column_slices_cover_the_dim():
    lay = ShardLayout(vocab_size=5, dim=8, column_shards=4)
    assert lay.width == 2 and lay.columns(3) == slice(6, 8)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: ShardLayout(4, 6, column_shards=4), ValueError, "column_shards 4 does not divide"),
        (lambda: ShardLayout(4, 4, row_shards=0), ValueError, "must be >= 1"),
        (
            lambda: ShardLayout(4, 4, 2).shard_rows(2),
            IndexError,
            r"row shard 2 out of range \[0, 2\)",
        ),
        (lambda: ShardLayout(4, 4, 1, 2).columns(-1), IndexError, "column slice -1 out of range"),
    ],
)
def test_bad_shapes_and_indices_are_refused(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_of_takes_the_plan_shards_except_for_a_dp_table():
    table = TableConfig(name="t", vocab_size=7, dim=4)
    rb = TablePlan(name="t", cluster="rb", row_shards=2, column_shards=1, devices=((0, 1),))
    dp = TablePlan(name="t", cluster=Cluster.DP, row_shards=1, column_shards=1, devices=((0, 1),))
    assert ShardLayout.of(table, rb) == ShardLayout(7, 4, row_shards=2)
    assert ShardLayout.of(table, dp) == ShardLayout(7, 4)
