"""The link bytes of a placed plan, per stacked group (`planner.traffic`), by hand on one
node of 4 devices with two 1000 x 16 fp32 tables (b = 16 samples per device)."""

from embark_jax.core.plan import Cluster
from embark_jax.planner import baseline
from embark_jax.planner.traffic import (
    dp_group_exchange,
    groups,
    plan_traffic,
    routed_bucket,
    slots_per_device,
)
from tests.planner.helpers import H100, model, table

M = model(table("a"), table("b"))
HW = H100.with_shape(1, 4)
COUNTS = 24.0  # 2 int32 counts per table, all-reduced on a ring of 4: 2 x 3/4 x 16 bytes


def members(kind):
    p = baseline(M, 64, HW, kind).plan
    (key, group), *rest = groups(M, p).items()
    assert not rest  # same cluster, width and dtype: one stacked group
    return p, key, group


def test_table_wise_rb_by_hand():
    p, key, group = members("tw")
    assert key == (Cluster.RB, 16, 4) and [t.name for t, _ in group] == ["a", "b"]
    # one table per device: the bucket is one table's (b H = 16 slots), one slot per device
    assert routed_bucket(group, 64, HW) == 16 and slots_per_device(group, 4) == 1
    ids = 16 * 2 * 4 * 3  # (row, bag) int32 per slot, to 3 peers
    vec = 2 * 16 * 16 * 4 * 3  # b partials of width 16 forward + gradients back, 3 peers
    assert plan_traffic(M, p, HW) == (ids + vec + COUNTS, 0.0)


def test_row_wise_rb_stacks_both_tables_on_every_device():
    p, _, group = members("rw")
    # each device holds a quarter of both tables: 13 slots each (the padded bucket at r = 4)
    assert routed_bucket(group, 64, HW) == 26 and slots_per_device(group, 4) == 2
    ids, vec = 26 * 2 * 4 * 3, 2 * 2 * 16 * 16 * 4 * 3
    assert plan_traffic(M, p, HW) == (ids + vec + COUNTS, 0.0)


def test_dp_group_exchange_is_sparse_for_large_replicas():
    _, key, group = members("dp")
    assert key[0] is Cluster.DP
    # 2000 replica rows vs 2 x 16 id slots and pooled gradient rows per device: the sparse
    # all-gather wins
    assert dp_group_exchange(group, 16, 16, 4) == (False, 2000, 32, 32)
