"""Which clusters and splits a table may take (`planner.enumerators`)."""

from embark_jax.core.plan import Cluster
from embark_jax.core.specs import Combiner
from embark_jax.planner.enumerators import can_split_rows, cluster_options, split_options
from embark_jax.planner.types import Option
from tests.planner.helpers import DP, RB, UB, table


def test_cluster_options_sorted_and_no_rb_for_sequences():
    assert cluster_options(table("t")) == [DP, RB, UB]
    assert cluster_options(table("s", combiner=Combiner.NONE)) == [DP, UB]


def test_split_options_by_hand():
    t = table("t", vocab=100, dim=32)
    assert split_options(t, RB, 4) == [
        ("columns", Option(Cluster.RB, 1, 2)),
        ("rows", Option(Cluster.RB, 2, 1)),
    ]
    assert split_options(table("t", dim=16), RB, 4) == [("rows", Option(Cluster.RB, 2))]
    assert split_options(table("t", vocab=1, dim=32), UB, 4) == [("columns", UB.with_columns(2))]
    assert split_options(t, Option(Cluster.RB, 2, 2), 4) == []  # no device for a 5th shard
    assert can_split_rows(t, RB, 2) and not can_split_rows(t, Option(Cluster.RB, 2), 2)
    assert not can_split_rows(t, DP, 8) and not can_split_rows(table("t", vocab=1), RB, 8)
