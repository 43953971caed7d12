"""Placing shards on devices (`planner.place`): order, node locality, errors."""

import pytest

from embark_jax.core.plan import Cluster
from embark_jax.planner import PlannerError
from embark_jax.planner.estimate import shard_cost, table_seconds
from embark_jax.planner.place import place
from embark_jax.planner.types import Option
from tests.planner.helpers import DP, RB, UB, model, problem, table


def test_place_hottest_first_on_least_loaded_devices():
    """'x' (hotter, 2 row shards) goes first on devices 0 and 1 (all equally loaded: ties
    by id); 'y' then on the least loaded, device 2; the DP table everywhere."""
    m = model(table("y"), table("x", hotness=10), table("d", vocab=10))
    p = problem(m)
    ev = place(p, {"x": Option(Cluster.RB, 2), "y": RB, "d": DP})
    devices = {t.name: t.devices for t in ev.plan.tables}
    assert devices == {"x": ((0, 1),), "y": ((2,),), "d": ((0, 1, 2, 3),)}
    assert [t.name for t in ev.plan.tables] == ["y", "x", "d"]  # model order
    x_mem = shard_cost(p, m.table("x"), Option(Cluster.RB, 2)).memory
    d_mem = shard_cost(p, m.table("d"), DP).memory
    y_mem = shard_cost(p, m.table("y"), RB).memory
    assert ev.device_memory.tolist() == [x_mem + d_mem] * 2 + [d_mem + y_mem, d_mem]


def test_place_keeps_rb_row_shards_in_one_node():
    """2 nodes x 2 devices: 'a' (hotter) lands on device 0; 'b' (2 row shards) would take
    the least-loaded devices 1 and 2 across nodes, but stays in node 1 (devices 2, 3)."""
    m = model(table("a", hotness=50), table("b"))
    p = problem(m, nodes=2, per_node=2)
    b2 = Option(Cluster.RB, 2)
    assert table_seconds(p, m.table("a"), RB) > table_seconds(p, m.table("b"), b2)
    ev = place(p, {"a": RB, "b": b2})
    assert {t.name: t.devices for t in ev.plan.tables} == {"a": ((0,),), "b": ((2, 3),)}


def test_place_errors_name_the_table():
    t = table("t")
    need = 72960.0  # see test_presplit_rows_by_hand
    p = problem(model(t), cap=need - 1)
    with pytest.raises(PlannerError) as e:
        place(p, {"t": RB})
    assert (e.value.table, e.value.need, e.value.available) == ("t", need, need - 1)
    # a fixed placement over the cap names the largest shard on the first full device
    p = problem(model(t, table("u", vocab=10)), cap=need)
    with pytest.raises(PlannerError, match="device 0 would hold") as e:
        place(p, {"t": RB, "u": UB}, fixed={"t": [[0]], "u": [[0]]})
    assert e.value.table == "t"
