"""`sparse_update`: fused in-place row updates of a table and its optimizer slots."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from embark_jax.core.specs import Combiner
from embark_jax.ops import _ffi, reference
from embark_jax.ops.backend import Backend, resolve
from embark_jax.ops.lookup import _FLOAT_DTYPES, id_scale, lookup_pool_backward, pooling_inputs
from embark_jax.ops.optimizers import SparseOptimizer, with_rounding_seed

__all__ = ["lookup_pool_backward_update", "merge_duplicate_rows", "sparse_update"]


def merge_duplicate_rows(
    rows: jax.Array, grads: jax.Array, *, backend: Backend | str | None = None
) -> tuple[jax.Array, jax.Array]:
    """Sums the gradients of repeated rows: returns `(unique rows [C] -1 padded, grads [C, D])`
    with the same capacity C as the input (the distinct rows always fit)."""
    c = rows.shape[0]
    if resolve(backend) is Backend.REFERENCE:
        uniq, inverse, _, _ = reference.unique(rows, c)
        return uniq, reference.segment_sum(grads.astype(jnp.float32), inverse, c)
    seg = jnp.arange(c, dtype=jnp.int32)
    uniq, merged, _ = _ffi.sparse_grad(
        grads, rows, seg, jnp.ones((c,), jnp.float32), c, per_id=True
    )
    return uniq, merged


def sparse_update(
    table: jax.Array,
    state: Any,
    rows: jax.Array,
    grads: jax.Array,
    optimizer: SparseOptimizer,
    *,
    assume_unique: bool = False,
    seed: jax.Array | int | None = None,
    backend: Backend | str | None = None,
) -> tuple[jax.Array, Any]:
    """Applies `optimizer` to the given rows only; returns the new `(table, state)`.

    Arguments:
      table: `[V, D]` float32 or bfloat16; state: `optimizer.init(table)`.
      rows: `[C]` int32/int64 row ids; -1 (and any id outside [0, V)) is padding.
      grads: `[C, D]` gradient of each row.
      assume_unique: skip merging duplicate rows (true for `lookup_pool_backward` output).
      seed: uint32 scalar; given, a bfloat16 table's updated elements are rounded
        stochastically with bits hashed from (seed, row, column), the same on every backend
        (`reference.stochastic_round_bf16`); None: to nearest even. Pass a new seed every
        step (`optimizers.rounding_seed`). float32 tables ignore it.

    With the FFI backend the update is in place when the caller donates `table` and the
    state (`jax.jit(..., donate_argnums=...)`): the kernel's outputs alias its inputs.
    """
    rows, grads = jnp.asarray(rows), jnp.asarray(grads, jnp.float32)
    if rows.ndim != 1 or grads.shape != (rows.shape[0], table.shape[1]):
        raise ValueError(
            f"sparse_update: rows [C] and grads [C, {table.shape[1]}] expected, got "
            f"{rows.shape} and {grads.shape}"
        )
    if not assume_unique:
        rows, grads = merge_duplicate_rows(rows, grads, backend=backend)
    if resolve(backend) is Backend.REFERENCE:
        return optimizer.update(table, state, rows, grads, seed=seed)
    slot_a, slot_b = optimizer.kernel_slots(table, state)
    new_table, a, b = _ffi.sparse_update(
        table, slot_a, slot_b, rows, grads, _hparams(optimizer, state, seed), optimizer.kernel_id
    )
    return new_table, optimizer.from_kernel_slots(state, a, b)


def _hparams(optimizer: SparseOptimizer, state: Any, seed) -> jax.Array:
    hp = optimizer.hparams(state)
    return hp if seed is None else with_rounding_seed(hp, seed)


def lookup_pool_backward_update(
    table: jax.Array,
    state: Any,
    output_grads: jax.Array,
    ids: jax.Array,
    segment_ids: jax.Array | None,
    weights: jax.Array | None = None,
    *,
    optimizer: SparseOptimizer,
    combiner: Combiner | str = Combiner.SUM,
    seed: jax.Array | int | None = None,
    backend: Backend | str | None = None,
) -> tuple[jax.Array, Any, jax.Array]:
    """Backward of `lookup_pool` fused with the optimizer (FBGEMM's fused backward).

    Equivalent to `lookup_pool_backward` followed by `sparse_update`, but each distinct row's
    gradient is reduced and applied at once, with no `[C, D]` gradient buffer and no capacity
    (nothing can overflow). Ids >= the table's rows are padding, as in the forward. `seed`:
    stochastic rounding of a bfloat16 table, as in `sparse_update`.

    Returns `(table, state, num_unique_rows)`; in place when `table`/`state` are donated.
    """
    combiner = Combiner.parse(combiner)
    ids, segment_ids = pooling_inputs(
        "lookup_pool_backward_update", ids, segment_ids, weights, combiner
    )
    g = jnp.asarray(output_grads)
    vocab = table.shape[0]
    per_id = combiner is Combiner.NONE
    scale = id_scale(ids, segment_ids, g.shape[0], weights, combiner, vocab)
    ids = jnp.where(scale != 0, ids, -1)
    if (  # dtypes the kernel does not take run on the reference, as in lookup_pool_backward
        resolve(backend) is Backend.REFERENCE
        or g.dtype not in _FLOAT_DTYPES
        or table.dtype not in _FLOAT_DTYPES
    ):
        n = ids.shape[0]
        rows, row_grads, _ = lookup_pool_backward(
            g,
            ids,
            segment_ids,
            weights,
            capacity=n,
            combiner=combiner,
            vocab_size=vocab,
            backend=backend,
        )
        table, state = optimizer.update(table, state, rows, row_grads, seed=seed)
        return table, state, jnp.sum((rows >= 0).astype(jnp.int32))
    slot_a, slot_b = optimizer.kernel_slots(table, state)
    new_table, a, b, num_unique = _ffi.sparse_grad_update(
        table,
        slot_a,
        slot_b,
        g,
        ids,
        segment_ids,
        scale,
        _hparams(optimizer, state, seed),
        optimizer.kernel_id,
        per_id,
    )
    return new_table, optimizer.from_kernel_slots(state, a, b), num_unique
