"""`python -m embark_jax demo`: a small model trained end to end on one device, through the
library's own training path (`TrainState`, `StepRunner`, `fit`): synthetic Zipf data, four
tables of the four combiners, a DLRM-style dense net, Adagrad on the tables (fused, in place)
and Adam on the dense part; progress lines, then held-out log loss and AUC.

No planner: every table sits whole on the one device (a reduction-based shard), the simplest
plan there is. The main job, `train`, plans the paper's model over several devices.
"""

from __future__ import annotations

import json

from embark_jax.cli.errors import make_parent
from embark_jax.core.plan import Plan, TablePlan, Topology
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig

__all__ = ["demo_config", "demo_plan", "run_demo"]


def demo_config() -> EmbeddingConfig:
    tables = [
        TableConfig(name=f"t{i}", vocab_size=v, dim=16)
        for i, v in enumerate([10_000, 2_000, 500, 50])
    ]
    features = [
        FeatureConfig(name=f"f{i}", table=f"t{i}", max_hotness=h, combiner=c)
        for i, (h, c) in enumerate([(8, "sum"), (4, "mean"), (2, "sqrtn"), (1, "sum")])
    ]
    return EmbeddingConfig.create(tables, features)


def demo_plan(config: EmbeddingConfig, batch_size: int) -> Plan:
    """Every table whole on device 0."""
    return Plan(
        topology=Topology(num_nodes=1, devices_per_node=1),
        batch_size=batch_size,
        tables=tuple(
            TablePlan(name=t.name, cluster="rb", row_shards=1, column_shards=1, devices=((0,),))
            for t in config.tables
        ),
    )


def run_demo(
    steps: int = 200,
    batch_size: int = 512,
    lr: float = 0.05,
    seed: int = 0,
    out: str | None = None,
    log_every: int = 20,
) -> dict:
    """Trains `steps` steps; returns (and writes to `out`) held-out logloss and AUC and the
    training throughput. `lr` is the tables' Adagrad rate (the dense net's Adam uses 1e-2)."""
    import optax

    from embark_jax.data.synthetic import SyntheticDataset
    from embark_jax.ops.optimizers import Adagrad
    from embark_jax.training import state as train_state
    from embark_jax.training.callbacks import Progress
    from embark_jax.training.loop import fit
    from embark_jax.training.models import DenseConfig
    from embark_jax.training.runner import StepRunner

    config = demo_config()
    ds = SyntheticDataset(config, batch_size=batch_size, seed=seed)
    setup, state = train_state.create(
        config,
        demo_plan(config, batch_size),
        dense=DenseConfig(kind="dlrm", bottom=(32, 16), top=(32, 1)),
        sparse_optimizer=Adagrad(learning_rate=lr),
        dense_optimizer=optax.adam(1e-2),
        num_dense=ds.num_dense,
        seed=seed,
    )
    runner = StepRunner(setup)
    callbacks = [Progress(runner, steps, batch_size, every=log_every)] if log_every else []
    state, summary = fit(runner, state, ds, steps, callbacks=callbacks)
    held_out = runner.evaluate(state, [ds.batch(10**6 + i) for i in range(4)])
    result = {
        "steps": steps,
        "batch_size": batch_size,
        "logloss": held_out["logloss"],
        "auc": held_out["auc"],
        "samples_per_s": summary.samples_per_s,
    }
    print(json.dumps(result, indent=1))
    if out:
        with open(make_parent(out), "w") as fh:
            json.dump(result, fh, indent=1)
    return result
