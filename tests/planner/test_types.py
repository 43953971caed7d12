"""The planner's shared types (`planner.types`): options, the error, problems, evaluations,
and the check that a given plan matches the model and hardware."""

import math

import numpy as np
import pytest

from embark_jax.core.plan import Cluster
from embark_jax.planner import PlannerError, baseline
from embark_jax.planner.types import Evaluation, Option, Problem, check_plan
from tests.planner.helpers import H100, model, table


def test_option_shards_and_sort_key():
    o = Option(Cluster.RB).with_rows(2).with_columns(3)
    assert (o.row_shards, o.column_shards, o.shards) == (2, 3, 6)
    assert o.sort_key == ("rb", 2, 3)
    assert sorted([Option(Cluster.UB), o, Option(Cluster.DP)], key=lambda x: x.sort_key)[0] == (
        Option(Cluster.DP)
    )


def test_planner_error_message_in_gb():
    e = PlannerError("t", 3e9, 1e9, "try more nodes")
    assert (e.table, e.need, e.available) == ("t", 3e9, 1e9)
    assert str(e) == (
        "table 't' does not fit: needs 3.00 GB on a device, 1.00 GB available "
        "(2.00 GB short); try more nodes"
    )
    assert isinstance(e, ValueError)


def test_problem_create_cap():
    m = model(table("a"), table("b"))
    hw = H100.with_shape(1, 2)
    p = Problem.create(m, 64, hw, 0.5)
    assert p.cap == 40e9 and sorted(p.tables) == ["a", "b"]
    assert Problem.create(m, 64, hw, None).cap == math.inf


def test_evaluation_step_and_bottleneck():
    ev = baseline(model(table("a")), 64, H100.with_shape(1, 2), "tw")
    ev = Evaluation(
        plan=ev.plan,
        device_compute=np.array([1.0, 3.0]),
        device_comm=np.array([2.0, 0.5]),
        device_intra=np.zeros(2),
        device_inter=np.zeros(2),
        device_memory=np.zeros(2),
        dense_s=0.5,
    )
    assert ev.bottleneck == 1 and ev.embedding_s == 3.5 and ev.step_s == 4.0
    assert ev.comm_share == 0.5 / 4.0 and ev.bound_ratio is None


def test_check_plan_names_the_mismatch():
    m = model(table("a"), table("b"))
    hw = H100.with_shape(1, 4)
    p = baseline(m, 64, hw, "tw").plan
    check_plan(m, p, hw)
    with pytest.raises(ValueError, match=r"^the plan is for 1x4 devices, the hardware .* is 2x2$"):
        check_plan(m, p, H100.with_shape(2, 2))
    with pytest.raises(ValueError, match=r"tables not in the model \['b'\]$"):
        check_plan(model(table("a")), p, hw)
    with pytest.raises(ValueError, match=r"tables without a placement \['c'\]$"):
        check_plan(model(table("a"), table("b"), table("c")), p, hw)
