"""A table's predicted seconds under one option (`planner.estimate`), by hand."""

import pytest

from embark_jax.core.plan import Cluster
from embark_jax.planner import cost as C
from embark_jax.planner.estimate import requester_cost, shard_cost, table_seconds
from embark_jax.planner.types import Option
from tests.planner.helpers import DP, SGD, model, problem, table


def test_table_seconds_by_hand():
    t = table("t", dim=16, hotness=3)
    p = problem(model(t))
    hw, g, b = p.hw, 4, 64 / 4
    per_shard = sum(C.seconds(C.rb_shard_cost(t, (2, 1), 64, hw, SGD), hw))
    requester = 2 * b * 2 * 16 * 4 / hw.memory_bw  # RB: sum 2 partials per sample
    rb2 = Option(Cluster.RB, 2)
    assert requester_cost(p, t, rb2) == C.Cost(compute=2 * b * 2 * 16 * 4)
    assert table_seconds(p, t, rb2) == pytest.approx(2 * per_shard + g * requester)
    dp = sum(C.seconds(C.dp_cost(t, 64, hw, SGD), hw))
    assert table_seconds(p, t, DP) == pytest.approx(g * dp)  # a replica per device
    # on several nodes RB is priced hierarchically
    p2 = problem(model(t), nodes=2, per_node=2)
    want = C.rb_shard_cost(t, (2, 1), 64, p2.hw, SGD, row_shards_in_node=2, hierarchical=True)
    assert shard_cost(p2, t, rb2, in_node=2) == want
