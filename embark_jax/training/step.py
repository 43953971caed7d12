"""The train step as a pure function `(setup, state, batch) -> (state, metrics)`.

One step (docs/design.md §8): the embedding lookup under `shard_map` (routing residuals
kept), the dense model's loss and its gradients with respect to the dense parameters and the
embedding outputs, the dense optax update, and the two-phase embedding update (output
gradients routed to the owners, the fused sparse optimizer staged, then committed in place;
bfloat16 tables round stochastically with the seed `rounding_seed(state.rng, state.step)`).
No dense `[V, d]` gradient is built for sharded tables, and nothing reads or copies a whole
table: the step costs O(ids), whatever the tables' size.

The step is transactional and in place at once: whether to commit is decided on device.
The verdict covers the loss, the new dense parameters and optax state (small), the new values
of the table rows the batch touches (staged before they are written), and, under
`overflow="error"`, the overflow and invalid counts. A refused step writes nothing: every
table, slot and dense leaf keeps its bits, `step` does not advance, and `metrics["status"]`
says why (`Refusal` bits). With the state donated, a refused step still costs one step.

Dynamic tables (`TrainSetup.dynamic`) are looked up beside the fixed ones and their update is
staged first; the verdict covers their staged rows too, and `metrics["dynamic"]` counts
their ids per table (`sharding.dynamic.COUNT_NAMES`). Their membership (which ids hold a
row) changes in the lookup, before the verdict: a refused step keeps the ids it inserted,
with their initial rows, and nothing else of it (`sharding.dynamic`). Under
`overflow="error"` an id dropped by a full bucket or a routing bucket refuses the step
(`Refusal.OVERFLOW`).
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from embark_jax.core.options import OverflowPolicy
from embark_jax.data.batch import Batch
from embark_jax.ops.optimizers import rounding_seed
from embark_jax.sharding.collection import apply_gradients_fn, lookup_fn
from embark_jax.sharding.dynamic import COUNT_NAMES
from embark_jax.training.state import TrainSetup, TrainState

__all__ = [
    "Refusal",
    "all_finite",
    "bce_loss",
    "compile_eval_step",
    "compile_train_step",
    "dynamic_lost",
    "eval_step",
    "train_step",
]


class Refusal(enum.IntFlag):
    """Why a step was not committed (bits of `metrics["status"]`; 0: committed)."""

    LOSS = 1  # the loss is NaN or inf
    DENSE = 2  # the dense update (parameters or optax state) is not finite
    SPARSE = 4  # a staged table row or optimizer slot is not finite
    OVERFLOW = 8  # ids overflowed a capacity under overflow="error"
    INVALID = 16  # ids outside their table under overflow="error"
    HALTED = 32  # the caller did not allow it (a runner halted by an earlier refusal)


def bce_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean binary cross-entropy from logits (numerically stable)."""
    return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits)


def all_finite(*trees) -> jax.Array:
    """`[]` bool: every floating-point element of `trees` is finite (one fused reduction).
    For small trees (the dense part); tables are checked row by row as they are staged."""
    flags = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(trees)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def _lookup(setup: TrainSetup, state: TrainState, batch: Batch):
    return lookup_fn(
        setup.lowered, setup.mesh, setup.options, state.tables, batch.sparse, with_invalid=True
    )


def _pre_verdict(setup: TrainSetup, loss, params, dense_opt, overflow, invalid) -> jax.Array:
    """`[]` int32 `Refusal` bits known before the sparse update is staged (`overflow`
    includes the dynamic tables' dropped ids)."""
    status = jnp.where(jnp.isfinite(loss), 0, int(Refusal.LOSS))
    status |= jnp.where(all_finite(params, dense_opt), 0, int(Refusal.DENSE))
    if setup.options.overflow is OverflowPolicy.ERROR:
        status |= jnp.where(jnp.sum(overflow) == 0, 0, int(Refusal.OVERFLOW))
        status |= jnp.where(jnp.sum(invalid) == 0, 0, int(Refusal.INVALID))
    return status.astype(jnp.int32)


def train_step(
    setup: TrainSetup, state: TrainState, batch: Batch, allow: jax.Array | bool = True
) -> tuple[TrainState, dict[str, Any]]:
    """One training step on a device batch; returns the new state and
    `{"loss", "logits" [B], "overflow", "invalid" ([num_tables] each, plan order),
    "applied" [] bool, "status" [] int32 (`Refusal` bits, 0 when applied)}`, and with
    dynamic tables `"dynamic"` `[num_dynamic_tables, len(COUNT_NAMES)]` int32. Ids outside
    their table are dropped like padding and counted as `invalid`. `allow` (a bool scalar)
    false refuses the step (`Refusal.HALTED`)."""
    outputs, residuals, overflow, invalid = _lookup(setup, state, batch)
    dyn = _dynamic_lookup(setup, state, batch, train=True)
    if dyn is not None:
        outputs = {**outputs, **dyn.outputs}

    def loss_fn(params, emb):
        logits = setup.dense_model(params)(batch.dense, emb)
        return bce_loss(logits, batch.labels), logits

    (loss, logits), (g_params, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state.dense_params, outputs
    )
    updates, dense_opt = setup.tx.update(g_params, state.dense_opt, state.dense_params)
    params = optax.apply_updates(state.dense_params, updates)
    dropped = overflow if dyn is None else jnp.concatenate([overflow, dynamic_lost(dyn.counts)])
    status = _pre_verdict(setup, loss, params, dense_opt, dropped, invalid)
    status |= jnp.where(allow, 0, int(Refusal.HALTED)).astype(jnp.int32)
    dyn_finite = jnp.bool_(True)
    if dyn is not None:
        seed = rounding_seed(state.rng, state.step)
        staged, dyn_finite = setup.dynamic.stage(dyn.states, dyn.residuals, g_emb, state.step, seed)
    tables, slots, applied, staging = apply_gradients_fn(
        setup.lowered,
        setup.mesh,
        setup.options,
        state.tables,
        state.slots,
        residuals,
        g_emb,
        setup.optimizers,
        batch.sparse,
        seed=rounding_seed(state.rng, state.step),  # bfloat16 stochastic rounding
        step=state.step,
        allow=(status == 0) & dyn_finite,
        staging=state.staging,
    )
    status |= jnp.where(applied | (status != 0), 0, int(Refusal.SPARSE)).astype(jnp.int32)
    dynamic = state.dynamic
    if dyn is not None:
        dynamic = setup.dynamic.commit(dyn.states, staged, applied)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(applied, new, old))
    new = state.replace(
        step=state.step + applied.astype(state.step.dtype),
        dense_params=keep(params, state.dense_params),
        dense_opt=keep(dense_opt, state.dense_opt),
        tables=tables,
        slots=slots,
        dynamic=dynamic,
        staging=staging,
    )
    metrics = {
        "loss": loss,
        "logits": logits,
        "overflow": overflow,
        "invalid": invalid,
        "applied": applied,
        "status": status,
    }
    if dyn is not None:
        metrics["dynamic"] = dyn.counts
    return new, metrics


def _dynamic_lookup(setup: TrainSetup, state: TrainState, batch: Batch, *, train: bool):
    if setup.dynamic is None:
        return None
    return setup.dynamic.lookup(state.dynamic, batch.dynamic, state.step, train=train)


def dynamic_lost(counts: jax.Array) -> jax.Array:
    """`[num_dynamic_tables]` int32 from the dynamic counts: ids a full bucket or a routing
    bucket dropped."""
    names = list(COUNT_NAMES)
    return counts[:, names.index("dropped")] + counts[:, names.index("overflow")]


def eval_step(setup: TrainSetup, state: TrainState, batch: Batch) -> jax.Array:
    """Predicted click probabilities `[B]` (no update)."""
    outputs = _lookup(setup, state, batch).outputs
    dyn = _dynamic_lookup(setup, state, batch, train=False)
    if dyn is not None:
        outputs = {**outputs, **dyn.outputs}
    return jax.nn.sigmoid(setup.dense_model(state.dense_params)(batch.dense, outputs))


def compile_train_step(setup: TrainSetup, *, donate: bool = True):
    """`train_step` jitted for `setup`. With `donate` (the default) the state is donated:
    tables and slots update in place and a refused step leaves them bit-identical, so the
    returned state is always the one to keep. Without, the input state also stays valid at
    the price of a copy of every table and slot per step (tests, comparisons)."""
    return jax.jit(functools.partial(train_step, setup), donate_argnums=(0,) if donate else ())


def compile_eval_step(setup: TrainSetup):
    return jax.jit(functools.partial(eval_step, setup))
