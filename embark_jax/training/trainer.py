"""Training: a Flax dense model on top of the `EmbeddingCollection`, one `jax.jit` per step.

The step (DESIGN.md §8): the embedding lookup (shard_map; routing residuals kept), the dense
model's forward and backward (`value_and_grad` wrt the dense parameters and the embedding
outputs), the dense optax update, and the embedding `apply_gradients` (gradients routed to
the owners, fused sparse optimizer, in place: the state is donated). No dense `[V, d]`
gradient exists for sharded tables. The same code runs on one process or many
(`embark_jax.training.distributed`): each process feeds its slice of the global batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embark_jax.core.plan import Plan
from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import SparseFeatures
from embark_jax.data.synthetic import Batch
from embark_jax.ops.optimizers import SparseOptimizer
from embark_jax.sharding import hlo_bytes as comm
from embark_jax.sharding.collection import EmbeddingCollection, apply_gradients_fn, lookup_fn
from embark_jax.sharding.lowering import lower
from embark_jax.sharding.routing import DEFAULT_CAPACITY_FACTOR
from embark_jax.training.metrics import StreamingAUC
from embark_jax.training.models import DenseConfig, make_model

__all__ = ["NonFiniteLossError", "Trainer", "bce_loss"]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the message names the step."""


def _maybe_inject_fault(step: int) -> None:
    """Fault injection for tests: EMBARK_FAULT_EXIT="process:step" makes that process die
    abruptly (exit code 3) before that step, as a crashed host would."""
    spec = os.environ.get("EMBARK_FAULT_EXIT")
    if not spec:
        return
    proc, at = (int(x) for x in spec.split(":"))
    if jax.process_index() == proc and step == at:
        sys.stdout.flush()
        os._exit(3)


def bce_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean binary cross-entropy from logits (numerically stable)."""
    return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits)


class Trainer:
    """Owns the embedding collection, the dense model, their optimizers and the jitted step.

    Arguments:
      config: tables and features; plan: the sharding plan (mesh from `plan.make_mesh()`).
      dense: the dense net (`DenseConfig`); num_dense: dense features per sample.
      sparse_optimizer: one `SparseOptimizer` or a mapping table name -> optimizer.
      dense_optimizer: an optax transformation (default Adam 1e-3).
      hierarchical, comm_dtype: passed to the collection (`comm_dtype="bfloat16"` sends
        embedding vectors and their gradients in bf16).
      overflow_policy: what a routing/dedup capacity overflow does: `count` (report it in
        the step's stats and `overflow_total`), `error` (raise `CapacityOverflowError`), or
        `grow` (count it, double the overflowing tables' capacities and recompile: later
        steps fit; the ids dropped in the overflowing step got no update).
      validate_inputs: check every batch on the host before it reaches a device.
    """

    def __init__(
        self,
        config: EmbeddingConfig,
        plan: Plan,
        *,
        dense: DenseConfig,
        sparse_optimizer: SparseOptimizer | Mapping[str, SparseOptimizer],
        dense_optimizer: optax.GradientTransformation | None = None,
        num_dense: int = 13,
        seed: int = 0,
        hierarchical: bool = True,
        comm_dtype: str | None = None,
        overflow_policy: str = "count",
        capacity_factor: float | None = None,
        validate_inputs: bool = True,
    ):
        if overflow_policy not in ("count", "error", "grow"):
            raise ValueError(
                f"overflow_policy must be count, error or grow, got {overflow_policy!r}"
            )
        self.overflow_policy = overflow_policy
        self.validate_inputs = validate_inputs
        self.num_dense = num_dense
        self.config = config
        self.plan = plan
        self.mesh = plan.make_mesh()
        rngs = nnx.Rngs(seed)
        self.collection = EmbeddingCollection(
            config.tables,
            config.features,
            plan,
            self.mesh,
            rngs=rngs,
            hierarchical=hierarchical,
            capacity_factor=capacity_factor,
            strict=overflow_policy == "error",
            optimizer=sparse_optimizer,
            comm_dtype=comm_dtype,
        )
        dims = {f.name: config.table_of(f).dim for f in config.features}
        model = make_model(dense, num_dense, dims, rngs=rngs)
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.tx = dense_optimizer or optax.adam(1e-3)
        replicated = NamedSharding(self.mesh, P())
        params = jax.device_put(params, replicated)
        self.state = {
            "dense": params,
            "dense_opt": jax.device_put(self.tx.init(params), replicated),
            "emb": self.collection.buffer_values(),
            "emb_opt": self.collection.state_values(),
            "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
        }
        self.batch_sharding = self.collection.lowered.sharding(self.mesh)
        self._step = jax.jit(self._train_step, donate_argnums=(0,))
        self._eval = jax.jit(self._eval_step)
        self.overflow_total = {t.name: 0 for t in plan.tables}
        self.last_checkpoint: str | None = None

    # --- the step ----------------------------------------------------------------------

    def _forward(self, params, embeddings, dense):
        return nnx.merge(self.graphdef, params)(dense, embeddings)

    def _train_step(self, state, sparse, dense, labels):
        coll = self.collection
        outputs, residuals, overflow = lookup_fn(
            coll.lowered, self.mesh, coll.options, state["emb"], sparse
        )

        def loss_fn(params, emb):
            logits = self._forward(params, emb, dense)
            return bce_loss(logits, labels), logits

        (loss, logits), (g_params, g_emb) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True
        )(state["dense"], outputs)
        updates, dense_opt = self.tx.update(g_params, state["dense_opt"], state["dense"])
        params = optax.apply_updates(state["dense"], updates)
        emb, emb_opt = apply_gradients_fn(
            coll.lowered,
            self.mesh,
            coll.options,
            state["emb"],
            state["emb_opt"],
            residuals,
            g_emb,
            coll.optimizers,
            sparse,
        )
        new_state = {
            "dense": params,
            "dense_opt": dense_opt,
            "emb": emb,
            "emb_opt": emb_opt,
            "step": state["step"] + 1,
        }
        return new_state, {"loss": loss, "probs": jax.nn.sigmoid(logits), "overflow": overflow}

    def _eval_step(self, state, sparse, dense):
        coll = self.collection
        outputs, _, _ = lookup_fn(coll.lowered, self.mesh, coll.options, state["emb"], sparse)
        return jax.nn.sigmoid(self._forward(state["dense"], outputs, dense))

    # --- data --------------------------------------------------------------------------

    def put_batch(self, batch: Batch) -> tuple[SparseFeatures, jax.Array, jax.Array]:
        """Places a global host batch on the mesh; with several processes each one supplies
        only its own rows (its devices' slice of the batch)."""
        tree = (batch.sparse, batch.dense, batch.labels)
        if jax.process_count() == 1:
            return jax.device_put(tree, self.batch_sharding)
        n, pid = jax.process_count(), jax.process_index()
        rows = batch.labels.shape[0] // n
        local = jax.tree.map(lambda x: np.asarray(x)[pid * rows : (pid + 1) * rows], tree)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), local
        )

    def _host(self, x) -> np.ndarray:
        if jax.process_count() == 1:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    # --- public ------------------------------------------------------------------------

    def check_batch(self, batch: Batch) -> None:
        """Host-side checks of a training batch; `ValueError` naming what is wrong."""
        labels = np.asarray(batch.labels)
        b = int(labels.shape[0]) if labels.ndim else 0
        g = self.plan.topology.num_devices
        if b == 0:
            raise ValueError("empty batch: no samples")
        if b % g:
            raise ValueError(f"batch size {b} is not a multiple of the {g} devices")
        if labels.shape != (b,) or not np.all((labels == 0) | (labels == 1)):
            raise ValueError(f"labels must be [B] zeros and ones, got shape {labels.shape}")
        dense = np.asarray(batch.dense)
        if dense.shape != (b, self.num_dense):
            raise ValueError(f"dense features must be [{b}, {self.num_dense}], got {dense.shape}")
        if not np.issubdtype(dense.dtype, np.number) or not np.all(np.isfinite(dense)):
            bad = np.argwhere(~np.isfinite(dense.astype(np.float64)))
            pos = tuple(int(i) for i in bad[0]) if len(bad) else ()
            raise ValueError(f"dense features must be finite numbers; bad value at {pos}")
        sparse = batch.sparse
        missing = sorted({f.name for f in self.config.features} - set(sparse.ids))
        if missing:
            raise ValueError(f"features {missing} are missing from the batch")
        if sparse.batch_size != b:
            raise ValueError(f"sparse batch size {sparse.batch_size} != {b} labels")
        for f in self.config.features:
            if sparse.hotness(f.name) != f.max_hotness:
                raise ValueError(
                    f"feature {f.name!r}: ids are [B, {sparse.hotness(f.name)}], "
                    f"the step is compiled for max_hotness {f.max_hotness}"
                )
        sparse.validate(self.config)

    def _grow(self, overflow: Mapping[str, int]) -> None:
        """Doubles the capacities of the tables that overflowed and recompiles the step."""
        tables = []
        for tp in self.plan.tables:
            if overflow.get(tp.name, 0) > 0:
                cf = 2.0 * (tp.capacity_factor or DEFAULT_CAPACITY_FACTOR)
                uc = None if tp.unique_capacity is None else 2 * tp.unique_capacity
                tp = dataclasses.replace(tp, capacity_factor=cf, unique_capacity=uc)
            tables.append(tp)
        self.plan = dataclasses.replace(self.plan, tables=tuple(tables))
        coll = self.collection
        coll.lowered = lower(self.plan, self.config, coll.lowered_optimizers())
        self._step = jax.jit(self._train_step, donate_argnums=(0,))
        self._eval = jax.jit(self._eval_step)

    def step(self, batch: Batch) -> dict[str, Any]:
        """One training step; returns loss, probabilities, labels and overflow (host)."""
        if self.validate_inputs:
            self.check_batch(batch)
        sparse, dense, labels = self.put_batch(batch)
        self.state, out = self._step(self.state, sparse, dense, labels)
        loss = float(out["loss"])
        step = int(self.state["step"])
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"loss is {loss} at step {step}; last good checkpoint: "
                f"{self.last_checkpoint or 'none saved'}"
            )
        overflow = {t.name: int(out["overflow"][i]) for i, t in enumerate(self.plan.tables)}
        for k, v in overflow.items():
            self.overflow_total[k] += v
        if self.overflow_policy == "error":
            self.collection.check_overflow(overflow)
        elif self.overflow_policy == "grow" and any(overflow.values()):
            self._grow(overflow)
        return {
            "loss": loss,
            "probs": self._host(out["probs"]),
            "labels": batch.labels,
            "overflow": overflow,
            "step": step,
        }

    def evaluate(self, batches) -> dict[str, float]:
        acc = StreamingAUC()
        for b in batches:
            sparse, dense, _ = self.put_batch(b)
            acc.update(b.labels, self._host(self._eval(self.state, sparse, dense)))
        return {"auc": acc.auc(), "logloss": acc.logloss()}

    def sync_collection(self) -> EmbeddingCollection:
        """Writes the trained tables and slots back into the collection's variables."""
        for k, v in self.state["emb"].items():
            self.collection.buffers[k].set_value(v)
        for k, v in self.state["emb_opt"].items():
            self.collection.opt_state[k].set_value(v)
        return self.collection

    def compiled_step(self, batch: Batch):
        sparse, dense, labels = self.put_batch(batch)
        return self._step.lower(self.state, sparse, dense, labels).compile()

    def comm_bytes_per_step(self, batch: Batch) -> dict[str, Any]:
        """Bytes of every collective in one compiled step, by kind and mesh axis."""
        mesh_shape = tuple(self.mesh.shape.values())
        by_axis = comm.collective_bytes(self.compiled_step(batch), mesh_shape, self.mesh.axis_names)
        return {
            "by_kind_axis": {f"{k}/{a}": v for (k, a), v in sorted(by_axis.items())},
            "total": int(sum(by_axis.values())),
            "links": comm.link_bytes(by_axis, mesh_shape),
        }

    def num_compilations(self) -> int:
        return self._step._cache_size()

    def fit(
        self,
        dataset,
        steps: int,
        *,
        start: int = 0,
        log_every: int = 10,
        out=sys.stdout,
        checkpoint_dir: str | None = None,
        save_every: int = 0,
        async_save: bool = False,
    ) -> dict[str, Any]:
        """Trains `steps` steps from batch `start`; prints a progress line with loss and
        samples/s; saves a checkpoint every `save_every` steps (and at the end) when
        `checkpoint_dir` is set (in the background with `async_save`, one save in flight at a
        time); returns the training summary."""
        from embark_jax.training import checkpoint

        acc = StreamingAUC()
        t0 = time.perf_counter()
        first = None
        losses = []
        pending = None
        for i in range(steps):
            _maybe_inject_fault(start + i)
            r = self.step(dataset.batch(start + i))
            losses.append(r["loss"])
            if (
                checkpoint_dir
                and save_every
                and ((start + i + 1) % save_every == 0 or i + 1 == steps)
            ):
                if pending is not None:
                    self.last_checkpoint = pending.wait()
                if async_save:
                    pending = checkpoint.save_async(
                        checkpoint_dir, self, data_position=start + i + 1
                    )
                else:
                    self.last_checkpoint = checkpoint.save(
                        checkpoint_dir, self, data_position=start + i + 1
                    )
            acc.update(r["labels"], r["probs"])
            if i == 0:
                first = time.perf_counter()  # the first step includes compilation
            done = i + 1
            if out is not None and (done % log_every == 0 or done == steps):
                elapsed = time.perf_counter() - (first if done > 1 else t0)
                sps = (done - 1) * dataset.batch_size / elapsed if done > 1 else 0.0
                bar = "#" * int(30 * done / steps)
                out.write(
                    f"\r[{bar:<30s}] step {start + done:6d}/{start + steps}  loss "
                    f"{np.mean(losses[-log_every:]):.4f}  {sps:9.0f} samples/s"
                )
                out.write("\n" if not out.isatty() or done == steps else "")
                out.flush()
        if pending is not None:
            self.last_checkpoint = pending.wait()
        end = time.perf_counter()
        timed = max(steps - 1, 1)
        return {
            "steps": steps,
            "final_loss": float(np.mean(losses[-log_every:])),
            "train_auc": acc.auc(),
            "train_logloss": acc.logloss(),
            "samples_per_s": timed * dataset.batch_size / max(end - (first or t0), 1e-9),
            "losses": losses,
        }
