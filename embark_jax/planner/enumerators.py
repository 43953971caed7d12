"""Stage `enumerate`: the candidate options of each table, always in a fixed sorted order.

A table may be replicated (DP), or sharded as RB (pooled features only: the owner pools
the ids and returns one partial vector per sample) or UB (one vector per distinct id, the
only choice for sequence outputs). A sharded table's option is then split further by
doubling its row shards or its column shards, as long as every shard has its own device,
every row shard at least one row and every column slice `MIN_COLUMN_WIDTH` elements.
"""

from __future__ import annotations

from embark_jax.core.plan import Cluster
from embark_jax.core.specs import Combiner
from embark_jax.planner.model import PlannerTable
from embark_jax.planner.types import Option

__all__ = [
    "MIN_COLUMN_WIDTH",
    "can_split_rows",
    "cluster_options",
    "split_options",
    "splits",
]

MIN_COLUMN_WIDTH = 16


def cluster_options(t: PlannerTable) -> list[Option]:
    """One unsplit option per cluster the table may use, sorted by cluster name."""
    clusters = [Cluster.DP, Cluster.UB]
    if t.combiner is not Combiner.NONE:  # RB returns pooled vectors only
        clusters.append(Cluster.RB)
    return sorted((Option(c) for c in clusters), key=lambda o: o.sort_key)


def split_options(t: PlannerTable, o: Option, num_devices: int) -> list[tuple[str, Option]]:
    """`o` with twice the row shards ("rows") or twice the column shards ("columns"),
    where that split is possible; sorted by how."""
    out = []
    if o.shards * 2 <= num_devices and o.row_shards * 2 <= t.vocab_size:
        out.append(("rows", o.with_rows(o.row_shards * 2)))
    c = o.column_shards * 2
    if t.dim % c == 0 and t.dim // c >= MIN_COLUMN_WIDTH and o.shards * 2 <= num_devices:
        out.append(("columns", o.with_columns(c)))
    return sorted(out, key=lambda x: x[0])


def can_split_rows(t: PlannerTable, o: Option, num_devices: int) -> bool:
    """Whether a table that found no room can take twice the row shards (a sharded table
    with more rows than row shards, and a device for every new shard)."""
    return (
        o.cluster is not Cluster.DP
        and t.vocab_size > o.row_shards
        and o.row_shards * 2 * o.column_shards <= num_devices
    )


def splits(t: PlannerTable, num_devices: int) -> list[Option]:
    """Every option the search may give `t`: DP, and each sharded cluster with row and
    column shards powers of two (slices >= `MIN_COLUMN_WIDTH` wide unless unsplit, at most
    one row per row shard, one shard per device); sorted."""
    out = []
    for base in cluster_options(t):
        if base.cluster is Cluster.DP:
            out.append(base)
            continue
        c = 1
        while c <= num_devices and t.dim % c == 0 and (c == 1 or t.dim // c >= MIN_COLUMN_WIDTH):
            r = 1
            while r * c <= num_devices and r <= t.vocab_size:
                out.append(Option(base.cluster, r, c))
                r *= 2
            c *= 2
    return sorted(out, key=lambda o: o.sort_key)
