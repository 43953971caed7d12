"""The cost model (`planner.cost`): per-shard bytes and seconds computed by hand."""

import dataclasses

import pytest

from embark_jax.planner import PlannerTable
from embark_jax.planner import cost as C
from tests.planner.helpers import ADAGRAD, HW1, SGD


def test_expected_unique_uniform_matches_closed_form():
    v, n = 1000, 500
    want = v * (1 - (1 - 1 / v) ** n)
    assert C.expected_unique(n, v, 0.0) == pytest.approx(want, rel=1e-6)
    assert C.expected_unique(0, v, 1.1) == 0.0
    # skew means fewer distinct ids than uniform for the same draws
    assert C.expected_unique(n, v, 1.1) < want


def test_rb_shard_cost_by_hand():
    hw = HW1.with_shape(2, 4)  # G = 8, L = 4
    t = PlannerTable(name="t", vocab_size=1000, dim=8, hotness=4, unique_ratio=None, alpha=0.0)
    batch = 16
    c = C.rb_shard_cost(
        t,
        split=(2, 1),
        batch=batch,
        hw=hw,
        slots=SGD,
        row_shards_in_node=1,
        hierarchical=True,
    )
    n_ids = 16 * 4 / 2  # 32 ids per shard
    touched = C.expected_unique(64, 1000, 0.0) / 2
    compute = (n_ids * 8 * 4 + 16 * 8 * 4) + (16 * 8 * 4 + n_ids * 8 * 4) + touched * 2 * 8 * 4
    assert c.compute == pytest.approx(compute)
    # each of 8 sources sends a padded bucket: b H = 2 x 4 = 8 slots, all of them at r = 2
    cap = 8
    assert C.rb_bucket(t, 2, batch, hw) == cap
    ids = cap * 8  # row + bag, int32, per peer (the own slice stays on the device)
    vec = 2 * 2 * 8 * 4  # b = 2 partials of width 8 forward, gradients back, per peer
    # hierarchical: N = 2 peers' slots to each of 3 local peers; across nodes one slot per
    # node, carried by the 1 row shard in this node for all L = 4 local ranks
    assert c.intra == pytest.approx(ids * 3 + vec * 3 * 2)
    assert c.inter == pytest.approx(ids * 4 + vec * 1 * 4)
    # the shard's 500 rows, the receive buffers, and the staged update: min(8 x 8 ids, 500
    # rows) slots of a row index and a new row (SGD: no optimizer slots)
    assert c.memory == pytest.approx(500 * 8 * 4 + 8 * cap * (8 + 32) + 64 * (4 + 32))
    flat = C.rb_shard_cost(t, (2, 1), batch, hw, SGD, hierarchical=False)
    assert flat.intra == pytest.approx((ids + vec) * 3)
    assert flat.inter == pytest.approx((ids + vec) * 4)


def test_ub_and_dp_costs_by_hand():
    hw = HW1.with_shape(1, 8)
    t = PlannerTable(name="t", vocab_size=100, dim=4, hotness=2, unique_ratio=0.5, alpha=0.0)
    slots = ADAGRAD  # one float slot per element
    ub = C.ub_shard_cost(t, (1, 1), batch=64, hw=hw, slots=slots)
    # the padded bucket: min(b H, V) = 16 dedup slots per source, whatever the unique ratio
    cap = 16
    assert C.ub_bucket(t, 1, 64, hw) == cap
    m = 8 * cap
    touched = C.expected_unique(128, 100, 0.0)
    assert ub.compute == pytest.approx(2 * m * 4 * 4 + m * 4 * 4 + touched * (2 * 16 + 2 * 4 * 4))
    assert ub.intra == pytest.approx(7 * cap * (4 + 2 * 16)) and ub.inter == 0
    # rows and Adagrad slots, the receive buffers, and the staged update of min(m = 128,
    # V = 100) rows: a row index, the new row and its new slots
    assert ub.memory == pytest.approx(100 * (16 + 16) + m * (4 + 16) + 100 * (4 + 16 + 16))
    # a capacity from data (`derive_capacities`) is what makes the dedup pay
    small = C.ub_shard_cost(t, (1, 1), batch=64, hw=hw, slots=slots, cap=8)
    assert small.intra == pytest.approx(ub.intra / 2)
    dp = C.dp_cost(t, 64, hw, slots)
    # the runtime's AUTO rule (core.dp_exchange), in words: dense 2 V (d + 1) + 2 V d = 1800
    # >= sparse 2 G (3 b H + b d) = 1280: the all-gather of b H id slots (row, bag, scale)
    # and b pooled gradient rows per device
    assert not C.dp_dense_gradients(t, 64, hw)
    assert dp.intra == pytest.approx(7 * (8 * 2 * 12 + 8 * 4 * 4)) and dp.inter == 0
    # the replica, and the staged update of every device's id slots: min(G b H = 128, 100)
    assert dp.memory == pytest.approx(100 * (16 + 16) + 100 * (4 + 16 + 16))
    small_v = dataclasses.replace(t, vocab_size=10)  # dense 180 < 1280: the all-reduce
    assert C.dp_dense_gradients(small_v, 64, hw)
    assert C.dp_cost(small_v, 64, hw, slots).intra == pytest.approx(2 * 10 * (16 + 4) * 7 / 8)


def test_seconds_and_dense_time():
    hw = HW1
    s = C.seconds(C.Cost(compute=hw.memory_bw, intra=hw.intra_bw, inter=2 * hw.inter_bw), hw)
    assert s == pytest.approx((1.0, 3.0))
    assert C.dense_seconds(1e6, 0, 8 * 1000, hw) == pytest.approx(3 * 1e6 * 1000 / hw.dense_flops)
