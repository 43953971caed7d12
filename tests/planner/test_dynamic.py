"""Pricing dynamic tables (`planner.dynamic`): capacity from the ids a table should hold,
the placement the planner picks, and, from outside the cost model, its link bytes against
the collectives of the compiled step (`sharding.hlo_bytes.wire_bytes`) for both
placements."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from embark_jax.core.dynamic import DynamicConfig, DynamicFeatureConfig, DynamicTableConfig
from embark_jax.ops.optimizers import RowWiseAdagrad
from embark_jax.planner import get_hardware
from embark_jax.planner.dynamic import (
    REPLICA_SHARE,
    DynamicTableSpec,
    dynamic_capacity,
    plan_dynamic,
    replicated_cost,
    sharded_cost,
)
from embark_jax.sharding.dynamic import DynamicShards
from embark_jax.sharding.hlo_bytes import wire_bytes

HW = get_hardware("h200", 1, 8)
ROWWISE = (0, 1)


def _spec(distinct, dim=64, hotness=4.0, name="t"):
    return DynamicTableSpec(name=name, dim=dim, hotness=hotness, distinct_ids=distinct)


def test_capacity_is_the_distinct_ids_at_the_load_in_whole_buckets():
    assert dynamic_capacity(_spec(20_000), 8) == 5024  # 20000 / 8 / 0.5 = 5000 -> 157 x 32
    assert dynamic_capacity(_spec(20_000), 8, replicated=True) == 40_000
    assert dynamic_capacity(_spec(3), 8) == 32  # at least one bucket
    half = DynamicTableSpec(name="t", dim=8, hotness=1, distinct_ids=1000, load=1.0)
    assert dynamic_capacity(half, 1) == 1024


def test_small_tables_are_replicated_and_large_ones_sharded():
    small, large = _spec(100, name="small"), _spec(100_000_000, name="large")
    by = {c.name: c for c in plan_dynamic([small, large], 65536, HW, ROWWISE)}
    assert by["small"].replicated and by["small"].replicated_s < by["small"].sharded_s
    assert by["small"].capacity == dynamic_capacity(small, 8, replicated=True)
    assert not by["large"].replicated and "over 5% of a device" in by["large"].reason
    copy = replicated_cost(large, 65536, HW, ROWWISE, dynamic_capacity(large, 8, True))
    assert copy.memory > REPLICA_SHARE * HW.memory_bytes
    one = get_hardware("h200", 1, 1)
    assert not plan_dynamic([small], 4096, one, ROWWISE)[0].replicated  # nothing to save


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dim", 0, "dim must be an int >= 1, got 0"),
        ("distinct_ids", 1.5, "distinct_ids must be an int >= 1, got 1.5"),
        ("hotness", 0, "hotness must be > 0, got 0"),
        ("load", 1.5, r"load must be in \(0, 1\], got 1.5"),
    ],
)
def test_bad_specs_are_one_line_errors(field, value, message):
    kw = {"name": "t", "dim": 8, "hotness": 1.0, "distinct_ids": 10, field: value}
    with pytest.raises(ValueError, match=rf"^dynamic table 't': {message}$"):
        DynamicTableSpec(**kw)


def _compiled_step_bytes(replicated: bool, capacity: int, batch: int, dim: int, hot: int):
    """Link bytes per device of one compiled training step of one dynamic table."""
    cfg = DynamicConfig(
        (DynamicTableConfig(name="t", dim=dim, capacity=capacity),),
        (DynamicFeatureConfig(name="f", table="t", max_hotness=hot),),
        replicated=("t",) if replicated else (),
    )
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    shards = DynamicShards(cfg, mesh, {"t": RowWiseAdagrad(learning_rate=0.1)})

    def step(states, ids):
        lk = shards.lookup(states, ids, 0)
        grads = {k: jnp.cos(v) for k, v in lk.outputs.items()}
        staged, ok = shards.stage(lk.states, lk.residuals, grads, 0)
        return shards.commit(lk.states, staged, ok)

    ids = {"f": jax.device_put(jnp.zeros((batch, hot, 2), jnp.uint32), NamedSharding(mesh, P("d")))}
    text = jax.jit(step).lower(shards.init(), ids).compile().as_text()
    return wire_bytes(text, (8,), ("d",))


@pytest.mark.parametrize("replicated", [False, True])
def test_predicted_link_bytes_match_the_compiled_step(replicated):
    batch, dim, hot = 512, 32, 3
    spec = DynamicTableSpec(name="t", dim=dim, hotness=hot, max_hotness=hot, distinct_ids=4096)
    cap = dynamic_capacity(spec, 8, replicated)
    price = replicated_cost if replicated else sharded_cost
    predicted = price(spec, batch, HW, ROWWISE, cap)
    measured = _compiled_step_bytes(replicated, cap, batch, dim, hot)
    assert measured["inter"] == predicted.inter == 0
    # the only bytes the model leaves out: the step's scalar flags and counts
    assert measured["intra"] == pytest.approx(predicted.intra, rel=0.01), (measured, predicted)
