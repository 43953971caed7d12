"""The baseline plans (tw, trw, rw, dp) and the fallback to the fastest one."""

import pytest

from embark_jax.core.plan import Plan
from embark_jax.core.specs import Combiner
from embark_jax.planner import BASELINES
from embark_jax.planner.baselines import baseline, best_of_baselines, evaluate
from embark_jax.planner.place import place
from tests.planner.helpers import H100, HW1, RB, model, problem, small_model, table


def test_baselines_by_hand():
    tables = [table(f"t{i}") for i in range(4)] + [table("s", vocab=1, combiner=Combiner.NONE)]
    m = model(*tables)
    hw = H100.with_shape(2, 2)

    def devices(kind):
        ev = baseline(m, 64, hw, kind)
        assert ev.name == kind and ev.reasons["t0"] == f"baseline {kind}"
        return [(t.cluster.value, t.devices) for t in ev.plan.tables]

    assert devices("tw") == [("rb", ((i,),)) for i in range(4)] + [("ub", ((0,),))]
    assert devices("trw") == [("rb", ((0, 1),)), ("rb", ((2, 3),))] * 2 + [("ub", ((0,),))]
    assert devices("rw") == [("rb", ((0, 1, 2, 3),))] * 4 + [("ub", ((0,),))]
    assert devices("dp") == [("dp", ((0, 1, 2, 3),))] * 5
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline(m, 64, hw, "nope")


def test_best_of_baselines_and_evaluate():
    m = model(table("a", hotness=10), table("b"))
    hw = H100.with_shape(1, 4)
    slow = place(problem(m), {"a": RB, "b": RB})
    slow.dense_s = 1.0  # slower than anything
    best, winner = best_of_baselines(slow, m, 64, hw, 0.9)
    steps = {k: baseline(m, 64, hw, k).step_s for k in BASELINES}
    assert winner == min(BASELINES, key=steps.get) and best.step_s == steps[winner]
    same, winner = best_of_baselines(best, m, 64, hw, 0.9)
    assert same is best and winner is None
    again = evaluate(m, Plan.from_json(best.plan.to_json()), hw)
    assert again.name == "given" and again.plan == best.plan and again.step_s == best.step_s


def test_the_fallback_takes_the_fastest_baseline():
    model = small_model()
    every = {b: baseline(model, 4096, HW1, b, with_bound=False) for b in BASELINES}
    slowest = max(every, key=lambda b: every[b].step_s)
    fastest = min(every, key=lambda b: every[b].step_s)
    assert every[fastest].step_s < every[slowest].step_s
    got, winner = best_of_baselines(every[slowest], model, 4096, HW1, 0.9)
    assert winner == fastest and got.step_s == every[fastest].step_s
    got, winner = best_of_baselines(every[fastest], model, 4096, HW1, 0.9)
    assert winner is None and got is every[fastest]
