"""The first cluster choice and row pre-split (`planner.propose`), by hand."""

import dataclasses

from embark_jax.core.plan import Cluster
from embark_jax.core.specs import Combiner
from embark_jax.planner.estimate import shard_cost
from embark_jax.planner.propose import choose_clusters, presplit_rows
from embark_jax.planner.types import Option
from tests.planner.helpers import DP, RB, UB, model, problem, table


def test_choose_clusters_dp_budget_by_hand():
    """Three tiny tables; a DP replica takes 10 x 16 x 4 = 640 bytes and its staged update
    min(4 devices x 16 ids, 10 rows) x (4 + 64) = 680 bytes, and the DP budget is 5% of
    40 kB = 2000 bytes: only the first table by name ('a') is replicated."""
    m = model(table("b", vocab=10), table("a", vocab=10), table("s", 10, combiner=Combiner.NONE))
    p = problem(m, memory_bytes=40_000.0)
    assert shard_cost(p, m.table("a"), DP).memory == 640 + 680
    options, decisions = choose_clusters(p)
    assert [d.table for d in decisions] == ["a", "b", "s"]
    assert options["a"] == DP and options["b"].cluster is not Cluster.DP
    assert [o for o, _ in decisions[0].priced] == [DP, RB, UB]
    assert [o for o, _ in decisions[1].priced] == [RB, UB]  # no budget left for DP
    assert [o for o, _ in decisions[2].priced] == [UB]  # sequence output: never RB
    for d in decisions:
        assert d.option == min(d.priced, key=lambda x: x[1])[0]


def test_presplit_rows_by_hand():
    """One RB shard of a 1000 x 16 fp32 table holds ceil(1000 / r) rows of 64 bytes plus
    receive buffers of (8 + 64) bytes per slot: 4 sources x the padded bucket of 16 slots
    (16, 16, 13 for r = 1, 2, 4), and its staged update, (4 + 64) bytes for each of the
    64, 64, 52 received ids: 72960, 40960, 23280 bytes. With a cap of 96 kB (a quarter:
    24 kB) the table starts with 4 row shards."""
    t = table("t")
    p = problem(model(t, table("d", vocab=10)), cap=96_000.0)
    mem = [shard_cost(p, t, Option(Cluster.RB, r)).memory for r in (1, 2, 4)]
    assert mem == [72960, 40960, 23280]
    out = presplit_rows(p, {"t": RB, "d": DP})
    assert out == {"t": Option(Cluster.RB, 4), "d": DP}
    # never more row shards than devices
    assert presplit_rows(dataclasses.replace(p, cap=4.0), {"t": RB, "d": DP})["t"].row_shards == 4
