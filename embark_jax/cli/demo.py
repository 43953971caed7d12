"""A small end-to-end demo on one device: synthetic Zipf data, embedding lookups through
`embark_jax.ops`, a logistic model trained with plain `jax.grad`, logloss and AUC printed.

It stands in for the `train` main job until the distributed training loop lands.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax import ops
from embark_jax.cli.errors import make_parent
from embark_jax.core.specs import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.synthetic import SyntheticDataset
from embark_jax.training.metrics import auc, logloss

__all__ = ["demo_config", "run_demo"]


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


def run_demo(
    steps: int = 200,
    batch_size: int = 512,
    lr: float = 0.05,
    seed: int = 0,
    out: str | None = None,
    log_every: int = 20,
) -> dict:
    cfg = demo_config()
    ds = SyntheticDataset(cfg, batch_size=batch_size, seed=seed)
    keys = jax.random.split(jax.random.key(seed), len(cfg.tables) + 1)
    params = {
        "tables": {t.name: t.init(k) for t, k in zip(cfg.tables, keys, strict=False)},
        "w": jnp.zeros((sum(cfg.table_of(f).dim for f in cfg.features) + ds.num_dense,)),
        "b": jnp.zeros(()),
    }

    def forward(p, sparse, dense):
        acts = []
        for f in cfg.features:
            ids, seg, w = sparse.flat(f.name)
            acts.append(
                ops.lookup_pool(
                    p["tables"][f.table],
                    ids,
                    seg,
                    dense.shape[0],
                    w,
                    f.combiner,
                    indices_are_sorted=True,
                )
            )
        x = jnp.concatenate([*acts, dense], axis=1)
        return x @ p["w"] + p["b"]

    def loss_fn(p, sparse, dense, labels):
        logits = forward(p, sparse, dense)
        return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits)

    @jax.jit
    def step(p, sparse, dense, labels):
        loss, g = jax.value_and_grad(loss_fn)(p, sparse, dense, labels)
        # embedding rows get a larger rate: each row is touched by few samples
        p = jax.tree.map(lambda a, b: a - lr * b, p, g)
        p["tables"] = jax.tree.map(lambda a, b: a - 20 * lr * b, p["tables"], g["tables"])
        return p, loss

    t0 = time.perf_counter()
    for i, bt in enumerate(ds.batches(num=steps)):
        params, loss = step(params, bt.sparse, jnp.asarray(bt.dense), jnp.asarray(bt.labels))
        if log_every and (i + 1) % log_every == 0:
            print(f"step {i + 1:5d}/{steps}  loss {float(loss):.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    ev = ds.batch(10**6)  # a held-out batch
    probs = np.asarray(jax.nn.sigmoid(forward(params, ev.sparse, jnp.asarray(ev.dense))))
    result = {
        "steps": steps,
        "batch_size": batch_size,
        "logloss": logloss(ev.labels, probs),
        "auc": auc(ev.labels, probs),
        "samples_per_s": steps * batch_size / elapsed,
    }
    print(json.dumps(result, indent=1))
    if out:
        with open(make_parent(out), "w") as fh:
            json.dump(result, fh, indent=1)
    return result
