"""Capacity sizing (`embark_jax.sharding.capacity`): the numbers the clusters allocate."""

import math

import numpy as np
import pytest

from embark_jax.core.options import RuntimeOptions
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.sharding.capacity import (
    DEFAULT_CAPACITY_FACTOR,
    TAIL_PROBABILITY,
    TableCapacity,
    binomial_capacity,
    derive_capacities,
    group_capacity,
    grow_capacities,
    table_capacity,
)
from embark_jax.sharding.clusters import CLUSTERS
from embark_jax.sharding.lowering import lower


def _setup(cluster, r=4, cf=None, uc=None):
    tables = [
        TableConfig(name="rw", vocab_size=64, dim=8),
        TableConfig(name="tw", vocab_size=9, dim=8),
    ]
    features = [
        FeatureConfig(name="f", table="rw", max_hotness=8),
        FeatureConfig(name="f2", table="rw", max_hotness=3),
        FeatureConfig(name="g", table="tw", max_hotness=2),
    ]
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=8),
        batch_size=16,
        tables=(
            TablePlan(
                name="rw",
                cluster=cluster,
                row_shards=r,
                column_shards=1,
                devices=(tuple(range(r)),),
                capacity_factor=cf,
                unique_capacity=uc,
            ),
            TablePlan(name="tw", cluster=cluster, row_shards=1, column_shards=1, devices=((1,),)),
        ),
    )
    return lower(plan, EmbeddingConfig.create(tables, features))


HOT = {"f": 8, "f2": 3, "g": 2}


def _tail(n, r, c):
    """P(Binomial(n, 1/r) > c), exactly (fractions), for the independent check."""
    from fractions import Fraction

    p = Fraction(1, r)
    return float(sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(c + 1, n + 1)))


@pytest.mark.parametrize(
    ("n", "r"), [(1, 4), (8, 4), (16, 4), (22, 4), (64, 4), (200, 8), (300, 2)]
)
def test_binomial_capacity_is_the_least_with_a_tiny_tail(n, r):
    c = binomial_capacity(n, r)
    assert c <= n
    assert _tail(n, r, c) < TAIL_PROBABILITY
    if c > 0:
        assert _tail(n, r, c - 1) >= TAIL_PROBABILITY  # the least such c
    assert binomial_capacity(n, 1) == n  # one shard gets everything


def test_rb_capacities():
    lowered = _setup("rb")
    opts = RuntimeOptions()
    # default: the binomial tail of the table's 2 * (8 + 3) = 22 slots over 4 row shards
    assert binomial_capacity(22, 4) == 16
    assert table_capacity(lowered, "rw", 2, HOT, opts) == TableCapacity(bucket=16)
    assert table_capacity(lowered, "tw", 2, HOT, opts) == TableCapacity(bucket=4)  # worst case
    # small counts get (nearly) their worst case: P(all 11 on one shard) = 4**-11 < 1e-6
    assert table_capacity(lowered, "rw", 1, HOT, opts) == TableCapacity(bucket=10)
    assert binomial_capacity(8, 4) == 8
    # device 1 holds a rw shard and the tw table
    assert group_capacity(lowered, lowered.groups[0], 2, HOT, opts) == 16 + 4
    # the table's factor wins over the options', which wins over the default
    assert (
        table_capacity(lowered, "rw", 2, HOT, RuntimeOptions(capacity_factor=1.0)).bucket == 4 + 2
    )
    assert (
        table_capacity(
            _setup("rb", cf=0.5), "rw", 2, HOT, RuntimeOptions(capacity_factor=1.0)
        ).bucket
        == 2 + 1
    )
    assert table_capacity(lowered, "tw", 2, HOT, RuntimeOptions(capacity_factor=0.5)).bucket == 2


def test_ub_capacities():
    lowered = _setup("ub", uc=10)
    opts = RuntimeOptions()
    cap = table_capacity(lowered, "rw", 2, HOT, opts)
    # unique: min(22 slots, V, 10); bucket: the binomial tail of 10 unique ids over 4 shards
    assert binomial_capacity(10, 4) == 9
    assert cap == TableCapacity(bucket=9, unique=10)
    assert table_capacity(lowered, "tw", 2, HOT, opts) == TableCapacity(bucket=4, unique=4)
    # an explicit factor overrides: ceil(2 * 10 / 4)
    cf = RuntimeOptions(capacity_factor=2.0)
    assert table_capacity(lowered, "rw", 2, HOT, cf) == TableCapacity(bucket=5, unique=10)
    big = _setup("ub")
    # at most the vocabulary; a row shard receives at most its 64 / 4 rows
    assert table_capacity(big, "rw", 64, HOT, opts) == TableCapacity(bucket=16, unique=64)


def test_clusters_allocate_the_sized_capacities():
    for cluster in ("rb", "ub"):
        lowered = _setup(cluster, cf=1.5, uc=7)
        opts = RuntimeOptions(capacity_factor=3.0)
        group = lowered.groups[0]
        cl = CLUSTERS[group.cluster](lowered, group, 2, HOT, opts)
        assert cl.capacity == group_capacity(lowered, group, 2, HOT, opts)
        if cluster == "ub":
            assert cl.unique_capacity == {
                t: table_capacity(lowered, t, 2, HOT, opts).unique for t in ("rw", "tw")
            }


def test_grow_doubles_the_factor_in_effect():
    lowered = _setup("ub", uc=10)
    plan = lowered.plan
    grown = grow_capacities(plan, ["rw"], RuntimeOptions())
    assert grown.table("rw").capacity_factor == 2 * DEFAULT_CAPACITY_FACTOR
    assert grown.table("rw").unique_capacity == 20
    assert grown.table("tw") == plan.table("tw")
    grown = grow_capacities(plan, ["rw", "tw"], RuntimeOptions(capacity_factor=1.5))
    assert grown.table("tw").capacity_factor == 3.0
    assert grown.table("tw").unique_capacity is None


def test_grow_from_the_default_sizing_never_shrinks_a_bucket():
    opts = RuntimeOptions()
    for cluster in ("rb", "ub"):
        lowered = _setup(cluster, r=8)
        hot = {f.name: f.max_hotness for f in lowered.config.features}
        before = table_capacity(lowered, "rw", 2, hot, opts).bucket
        grown = grow_capacities(lowered.plan, ["rw"], opts, config=lowered.config)
        after = table_capacity(lower(grown, lowered.config), "rw", 2, hot, opts).bucket
        # grows, unless already at the most that can arrive: all 22 slots (rb), or the 64 / 8
        # rows of a shard (ub: unique ids)
        assert after > before or after == {"rb": 22, "ub": 8}[cluster], (cluster, before, after)
        # the default sizing amounts to more than DEFAULT_CAPACITY_FACTOR at this size
        assert grown.table("rw").capacity_factor > 2 * DEFAULT_CAPACITY_FACTOR


def _slots(lowered, table, opts):
    """Device -> the bucket slots `table`'s requests to its shard there may take: the
    group's bucket less the capacities of the other tables' shards on that device."""
    hot = {f.name: f.max_hotness for f in lowered.config.features}
    group = lowered.group_of(table)
    bucket = group_capacity(lowered, group, 2, hot, opts)
    cap = {t: table_capacity(lowered, t, 2, hot, opts).bucket for t in group.tables}
    devices = {s.device for s in group.shards if s.table == table}
    return {
        d: bucket - sum(cap[s.table] for s in group.shards if s.device == d and s.table != table)
        for d in devices
    }


@pytest.mark.parametrize(("cluster", "uc"), [("rb", None), ("ub", None), ("ub", 6)])
@pytest.mark.parametrize("cf", [0.2, 0.5, None])
def test_each_growth_doubles_the_slots_the_table_had_padding_included(cluster, uc, cf):
    """ "rw" is sized below "tw", whose shard shares device 1 and so pads the group's bucket:
    "rw" could use that padding, and doubling its factor alone left the bucket as it was."""
    opts = RuntimeOptions()
    lowered = _setup(cluster, cf=cf, uc=uc)
    worst = {"rb": 22, "ub": 16}[cluster]  # every slot, or a shard's 64 / 4 rows (ub)
    for _ in range(4):
        before = _slots(lowered, "rw", opts)
        grown = grow_capacities(lowered.plan, ["rw"], opts, lowered=lowered)
        lowered = lower(grown, lowered.config)
        after = _slots(lowered, "rw", opts)
        for d, n in before.items():
            assert after[d] >= min(2 * n, worst), (d, before, after)
    by_config = grow_capacities(
        _setup(cluster, cf=cf, uc=uc).plan, ["rw"], opts, config=lowered.config
    )
    assert by_config == grow_capacities(
        _setup(cluster, cf=cf, uc=uc).plan, ["rw"], opts, lowered=_setup(cluster, cf=cf, uc=uc)
    )


def test_derive_capacities_from_skewed_batches():
    lowered = _setup("ub")
    rng = np.random.default_rng(0)
    batch = SparseFeatures.from_dense(
        {
            "f": rng.integers(0, 4, size=(16, 8)) * 4,  # every id on row shard 0
            "f2": rng.integers(0, 64, size=(16, 3)),
            "g": rng.integers(0, 9, size=(16, 2)),
        }
    )
    tuned = derive_capacities(lowered.plan, lowered.config, [batch], margin=1.0)
    rw = tuned.table("rw")
    assert rw.unique_capacity is not None and rw.unique_capacity <= 64
    assert rw.capacity_factor >= 1.0
    assert tuned.table("tw").capacity_factor is None  # table-wise: exact worst case
