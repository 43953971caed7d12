"""The train step as a pure function `(setup, state, batch) -> (state, metrics)`.

One step (docs/design.md §8): the embedding lookup under `shard_map` (routing residuals
kept), the dense model's loss and its gradients with respect to the dense parameters and the
embedding outputs, the dense optax update, and the two-phase embedding update (output
gradients routed to the owners, fused sparse optimizer, in place when the state is donated;
bfloat16 tables round stochastically with the seed `rounding_seed(state.rng, state.step)`).
No dense `[V, d]` gradient is built for sharded tables. The same code runs on one process or
many: the batch is a global array sharded by sample.

The metrics include `finite`: one on-device reduction saying whether the loss and every
floating-point leaf of the *new* state (tables, slots, dense parameters, optax state) are
finite, so a step whose update produced NaN or inf (e.g. a diverging learning rate) is
caught even when the loss it started from was finite. It reads each buffer once.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from embark_jax.data.batch import Batch
from embark_jax.ops.optimizers import rounding_seed
from embark_jax.sharding.collection import apply_gradients_fn, lookup_fn
from embark_jax.training.state import TrainSetup, TrainState

__all__ = [
    "all_finite",
    "bce_loss",
    "compile_eval_step",
    "compile_train_step",
    "eval_step",
    "train_step",
]


def bce_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean binary cross-entropy from logits (numerically stable)."""
    return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits)


def all_finite(*trees) -> jax.Array:
    """`[]` bool: every floating-point element of `trees` is finite (one fused reduction)."""
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


def train_step(
    setup: TrainSetup, state: TrainState, batch: Batch
) -> tuple[TrainState, dict[str, Any]]:
    """One training step on a device batch; returns the new state and
    `{"loss", "probs" [B], "overflow", "invalid" ([num_tables] each, plan order),
    "finite" []}`. Ids outside their table are dropped like padding and counted as
    `invalid`."""
    outputs, residuals, overflow, invalid = _lookup(setup, state, batch)

    def loss_fn(params, emb):
        logits = setup.dense_model(params)(batch.dense, emb)
        return bce_loss(logits, batch.labels), logits

    (loss, logits), (g_params, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state.dense_params, outputs
    )
    updates, dense_opt = setup.tx.update(g_params, state.dense_opt, state.dense_params)
    params = optax.apply_updates(state.dense_params, updates)
    tables, slots = apply_gradients_fn(
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
    )
    new = state.replace(
        step=state.step + 1, dense_params=params, dense_opt=dense_opt, tables=tables, slots=slots
    )
    finite = all_finite(loss, new.dense_params, new.dense_opt, new.tables, new.slots)
    metrics = {
        "loss": loss,
        "probs": jax.nn.sigmoid(logits),
        "overflow": overflow,
        "invalid": invalid,
    }
    return new, {**metrics, "finite": finite}


def eval_step(setup: TrainSetup, state: TrainState, batch: Batch) -> jax.Array:
    """Predicted click probabilities `[B]` (no update)."""
    outputs = _lookup(setup, state, batch).outputs
    return jax.nn.sigmoid(setup.dense_model(state.dense_params)(batch.dense, outputs))


def compile_train_step(setup: TrainSetup, *, donate: bool = True):
    """`train_step` jitted for `setup`. With `donate` the state is donated (tables update in
    place; the input state is gone after the call); without, the input state stays valid
    and the step writes new buffers (one extra copy of the tables and slots)."""
    return jax.jit(functools.partial(train_step, setup), donate_argnums=(0,) if donate else ())


def compile_eval_step(setup: TrainSetup):
    return jax.jit(functools.partial(eval_step, setup))
