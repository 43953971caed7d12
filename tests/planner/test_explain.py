"""The per-table reasons written from the search trace (`planner.explain`)."""

from embark_jax.core.plan import Cluster
from embark_jax.planner.explain import explain
from embark_jax.planner.types import ClusterChoice, Option, Refinement, Retarget, RowSplit, Trace
from tests.planner.helpers import DP, RB, UB, model, table


def test_explain_from_the_trace_by_hand():
    m = model(table("a", hotness=2.5), table("b"))
    trace = Trace(
        clusters=[
            ClusterChoice("a", RB, ((DP, 3e-6), (RB, 1.25e-6), (UB, 2e-6))),
            ClusterChoice("b", DP, ((DP, 1e-6),)),
        ],
        steps=[
            RowSplit("a", 2),
            Refinement("a", "columns", Option(Cluster.RB, 2, 2), 3, 2e-3, 1.5e-3),
        ],
    )
    assert explain(m, trace) == {
        "a": "rb: pooling 2.5 ids/sample at the owner compresses traffic "
        "[dp 3.0 us, rb 1.2 us, ub 2.0 us]; rows split to 2 to fit the memory cap; "
        "split columns -> r=2 c=2 (it was the heaviest shard on the bottleneck device 3: "
        "step 2.000 -> 1.500 ms)",
        "b": "dp: small replica, no routing [dp 1.0 us]",
    }
    # a bound-guided start's option that was not the cheapest alone says so, with its target
    trace.clusters[1] = ClusterChoice("b", DP, ((DP, 3e-6), (RB, 1e-6)))
    trace.steps = [Retarget("b", DP, 2e-3, 1e-3)]
    assert explain(m, trace)["b"] == (
        "dp: not the cheapest alone (rb), but it balances the devices [dp 3.0 us, rb 1.0 us]; "
        "r=1 c=1: its fewest device-seconds with shards under a target of 2.000 ms per device "
        "(2.00x the bound)"
    )
    trace.baseline = "trw"
    assert explain(m, trace) == {n: "baseline trw was predicted fastest" for n in ("a", "b")}
