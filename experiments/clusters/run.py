"""When DP, RB or UB wins: bytes per device of one table in each cluster, predicted by the
planner's cost model and read from the real train step's HLO (the code of `clusters.ipynb`
beside this file).

One table, one feature of `hotness` ids per sample drawn from a Zipf(1.1) law over `vocab`
rows, `dim`-wide vectors, a global batch `batch`, `g` devices on one node:

  dp  the table replicated on every device; gradients exchanged as the runtime chooses
      (dense all-reduce of the [V, d] gradient, or all-gather of the per-id gradients)
  rb  row-split over all devices; each shard pools its ids and returns one partial vector
      per sample (reduction-based)
  ub  row-split over all devices; each device sends its distinct ids, gets one vector per
      distinct id back and pools locally (unique-based)

Routing capacities are sized from the data (`derive_capacities` on a few batches), as a
production run would, so that the padded buffers UB and RB send track the ids really sent.

Predicted: `embark_jax.planner.evaluate` of the one-table plan, link bytes of the device that
moves the most. Measured: the collectives of the jitted train step as JAX lowers it (the
embedding exchange; the dense net's gradient all-reduce is added later by XLA's partitioner
and is not counted), per device, in the planner's convention (`hlo_bytes.wire_bytes`).
"""

from __future__ import annotations

import numpy as np

from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.planner import ModelSpec, evaluate, get_hardware

CLUSTERS = ("dp", "rb", "ub")
BASE = {"vocab": 100_000, "hotness": 4, "g": 8, "batch": 512, "dim": 16}


def setup(cluster: str, *, vocab: int, hotness: int, g: int, batch: int, dim: int):
    """Config, plan (capacities not yet derived) and planner model of one table."""
    config = EmbeddingConfig.create(
        [TableConfig(name="t", vocab_size=vocab, dim=dim)],
        [FeatureConfig(name="f", table="t", max_hotness=hotness)],
    )
    every = (tuple(range(g)),)
    shards = 1 if cluster == "dp" else min(g, vocab)
    plan = Plan(
        topology=Topology(num_nodes=1, devices_per_node=g),
        batch_size=batch,
        tables=(
            TablePlan(
                name="t",
                cluster=cluster,
                row_shards=shards,
                column_shards=1,
                devices=every if cluster == "dp" else (tuple(range(shards)),),
            ),
        ),
    )
    spec = ModelSpec.from_config(config, slot_footprint=(0, 0), name="one-table")
    return config, plan, spec


def batches(config: EmbeddingConfig, batch: int, n: int = 4):
    from embark_jax.data.synthetic import SyntheticDataset

    ds = SyntheticDataset(config, batch_size=batch, seed=0)
    return [ds.batch(i) for i in range(n)]


def with_capacities(plan: Plan, config: EmbeddingConfig, host) -> Plan:
    from embark_jax.sharding.capacity import derive_capacities

    return derive_capacities(plan, config, [b.sparse for b in host])


def predicted(spec: ModelSpec, plan: Plan, g: int, topology: str = "local") -> dict:
    """Link bytes per step of the device that moves the most (intra / inter node); above 8
    devices the predicted machine has nodes of 8."""
    local = min(g, 8)
    hw = get_hardware(topology, g // local, local)
    if hw.num_nodes > 1:
        plan = Plan(topology=hw.topology, batch_size=plan.batch_size, tables=plan.tables)
    ev = evaluate(spec, plan, hw)
    intra, inter = ev.device_intra * hw.intra_bw, ev.device_inter * hw.inter_bw
    d = int(np.argmax(intra + inter))
    return {"bytes": float(intra[d] + inter[d]), "inter": float(inter[d])}


def measured(config: EmbeddingConfig, plan: Plan, host) -> float:
    """Bytes one device sends per step in the embedding collectives of the train step."""
    import jax
    import optax

    from embark_jax.ops import optimizers as O
    from embark_jax.training.models import DenseConfig
    from embark_jax.training.state import create
    from embark_jax.training.step import compile_train_step
    from experiments.ablation.run import link_bytes

    st, state = create(
        config,
        plan,
        dense=DenseConfig(bottom=(16,), top=(16, 1), cross_layers=1, cross_rank=8),
        sparse_optimizer=O.SGD(learning_rate=0.05),
        dense_optimizer=optax.sgd(1e-3),
    )
    batch = jax.device_put(host[0], st.table_sharding)
    lowered = compile_train_step(st).lower(state, batch)
    links = link_bytes(lowered.as_text(dialect="hlo"), st.mesh)
    return links["intra"] + links["inter"]


def point(cluster: str, measure: bool = True, **kw) -> dict:
    """Predicted (and measured, with `measure` and at most 8 devices) bytes per device of
    one table in `cluster` with the settings `kw` (defaults `BASE`)."""
    kw = {**BASE, **kw}
    config, plan, spec = setup(cluster, **kw)
    host = batches(config, kw["batch"])
    plan = with_capacities(plan, config, host)
    row = {"cluster": cluster, **kw}
    pred = predicted(spec, plan, kw["g"])
    row.update(pred_bytes=pred["bytes"], pred_inter=pred["inter"])
    if measure and kw["g"] <= 8:
        row["meas_bytes"] = measured(config, plan, host)
    return row


def sweep(name: str, values, measured_values=(), **kw) -> list[dict]:
    """Every cluster at every value of the setting `name` (predicted), measured too at the
    values in `measured_values`."""
    return [
        point(c, measure=v in measured_values, **{**kw, name: v}) for v in values for c in CLUSTERS
    ]
