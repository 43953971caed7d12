"""Refining a placement (`planner.refine`): fit the memory cap, split the bottleneck."""

import pytest

from embark_jax.core.plan import Cluster
from embark_jax.planner import PlannerError
from embark_jax.planner.enumerators import split_options
from embark_jax.planner.place import place
from embark_jax.planner.refine import fit_memory, improve
from embark_jax.planner.types import Option, RowSplit
from tests.planner.helpers import RB, model, problem, table


def test_fit_memory_splits_the_table_that_finds_no_room():
    """The table needs 68608 bytes in one shard, 34304 in two: with a 50 kB cap it fits
    once its rows are split in two."""
    p = problem(model(table("t")), cap=50_000.0)
    ev, options, splits = fit_memory(p, {"t": RB})
    assert options == {"t": Option(Cluster.RB, 2)} and splits == [RowSplit("t", 2)]
    assert ev.plan.tables[0].devices == ((0, 1),)
    with pytest.raises(PlannerError):  # one row cannot split
        fit_memory(problem(model(table("t", vocab=1)), cap=10.0), {"t": RB})


def test_improve_splits_the_bottleneck_until_no_device_is_left():
    """One hot table on 2 devices: the first split (rows or columns, whichever is faster)
    spreads it over both devices; then no split has a device left."""
    t = table("t", vocab=100_000, dim=64, hotness=20)
    p = problem(model(t), batch=1024, per_node=2)
    start = place(p, {"t": RB})
    same, options, steps = improve(p, {"t": RB}, start, max_rounds=0)
    assert same is start and options == {"t": RB} and steps == []
    ev, options, steps = improve(p, {"t": RB}, start, max_rounds=5)
    assert len(steps) == 1 and options["t"].shards == 2
    s = steps[0]
    assert (s.table, s.device, s.before_s, s.after_s) == ("t", 0, start.step_s, ev.step_s)
    by_hand = {how: place(p, {"t": o}).step_s for how, o in split_options(t, RB, 2)}
    assert s.how == min(by_hand, key=by_hand.get) and ev.step_s == min(by_hand.values())
    assert ev.step_s < start.step_s
