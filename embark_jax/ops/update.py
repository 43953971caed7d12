"""Sparse optimizer updates of table rows: in place, or staged and committed on a verdict.

- `sparse_update`: fused in-place row updates of a table and its optimizer slots.
- `lookup_pool_backward_update`: the backward of `lookup_pool` fused with the optimizer,
  in place (FBGEMM's fused backward).
- `stage_backward_update` + `commit_update`: the same update, undoable. The stage updates
  every touched row in place and saves the rows' previous weights and slots to `[C, ...]`
  staging arrays (O(ids)), and says whether the updated values are all finite; the commit
  keeps the update, or, given a false verdict, writes the saved rows back. A training step
  decides the verdict on device after the stage (docs/design.md §8), so a step reads and
  writes each touched row once, in place, and still never keeps a bad update.

This module is also the adapter between the optimizers (`ops.optimizers`: NamedTuple states,
hyper-parameters as traced scalars) and the kernels' ABI (`ops.abi`: two slot operands, one
float32 hyper-parameter vector).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from embark_jax.core.specs import Combiner
from embark_jax.ops import _ffi, abi, reference
from embark_jax.ops.backend import Backend, resolve
from embark_jax.ops.lookup import (
    _FLOAT_DTYPES,
    check_grad_rows,
    id_scale,
    lookup_pool_backward,
    pooling_inputs,
)
from embark_jax.ops.optimizers import SparseOptimizer, stored_values

__all__ = [
    "StagedUpdate",
    "Staging",
    "commit_update",
    "kernel_hparams",
    "kernel_slots",
    "lookup_pool_backward_update",
    "merge_duplicate_rows",
    "read_marker",
    "sparse_update",
    "stage_backward_update",
]


# --- the kernels' ABI ------------------------------------------------------------------


def kernel_hparams(
    optimizer: SparseOptimizer,
    state: Any,
    step: jax.Array | int | None = None,
    seed: jax.Array | int | None = None,
) -> jax.Array:
    """The kernels' float32 hyper-parameter vector (layout `abi.Hparam`) for `optimizer` at
    `step`; with a uint32 `seed`, bfloat16 tables round stochastically (split into two exact
    float32 halves, `SEED_LO` / `SEED_HI`)."""
    entries = [jnp.float32(0.0)] * abi.HPARAM_COUNT
    for name, value in optimizer.hparams(state, step).items():
        entries[abi.Hparam[name.upper()]] = jnp.asarray(value, jnp.float32)
    if seed is not None:
        seed = jnp.asarray(seed).astype(jnp.uint32)
        entries[abi.Hparam.ROUNDING] = jnp.float32(1.0)
        entries[abi.Hparam.SEED_LO] = (seed & jnp.uint32(0xFFFF)).astype(jnp.float32)
        entries[abi.Hparam.SEED_HI] = (seed >> 16).astype(jnp.float32)
    return jnp.stack(entries)


def kernel_slots(optimizer: SparseOptimizer, state: Any) -> tuple[jax.Array, jax.Array]:
    """The two slot operands of the kernels: the state's slot arrays in order, unused ones
    `[1]` dummies (`abi.SLOT_FOOTPRINT` says which the kernel reads)."""
    dummy = jnp.zeros((1,), jnp.float32)
    return (*optimizer.slot_arrays(state), dummy, dummy)[:2]


def from_kernel_slots(
    optimizer: SparseOptimizer, state: Any, a: jax.Array, b: jax.Array, applied=1
) -> Any:
    """The state after a kernel returned slot operands `a` and `b` (`applied`: committed)."""
    n = len(optimizer.slot_names)
    return optimizer.advance(state, (a, b)[:n], applied)


def _slot_widths(optimizer: SparseOptimizer, dim: int) -> tuple[int, int]:
    """Floats per table row in slot operands a and b (`abi::SlotRowWidth`)."""
    per_element, per_row = abi.SLOT_FOOTPRINT[optimizer.kernel_id]
    widths = [dim] * per_element + [1] * per_row
    return tuple((*widths, 0, 0)[:2])


def _uses_kernels(backend, *dtypes) -> bool:
    return resolve(backend) is Backend.FFI and all(jnp.dtype(d) in _FLOAT_DTYPES for d in dtypes)


# --- in place --------------------------------------------------------------------------


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
    step: jax.Array | int | None = None,
    seed: jax.Array | int | None = None,
    backend: Backend | str | None = None,
) -> tuple[jax.Array, Any]:
    """Applies `optimizer` to the given rows only; returns the new `(table, state)`.

    Arguments:
      table: `[V, D]` float32 or bfloat16; state: `optimizer.init(table)`.
      rows: `[C]` int32/int64 row ids; -1 (and any id outside [0, V)) is padding.
      grads: `[C, D]` gradient of each row.
      assume_unique: skip merging duplicate rows (true for `lookup_pool_backward` output).
      step: the optimizer's step counter (a learning-rate schedule is evaluated at it;
        required when the rate is a schedule).
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
        return optimizer.update(table, state, rows, grads, step=step, seed=seed)
    slot_a, slot_b = kernel_slots(optimizer, state)
    hp = kernel_hparams(optimizer, state, step, seed)
    new_table, a, b = _ffi.sparse_update(
        table, slot_a, slot_b, rows, grads, hp, optimizer.kernel_id
    )
    return new_table, from_kernel_slots(optimizer, state, a, b)


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
    step: jax.Array | int | None = None,
    seed: jax.Array | int | None = None,
    backend: Backend | str | None = None,
) -> tuple[jax.Array, Any, jax.Array]:
    """Backward of `lookup_pool` fused with the optimizer (FBGEMM's fused backward).

    Equivalent to `lookup_pool_backward` followed by `sparse_update`, but each distinct row's
    gradient is reduced and applied at once, with no `[C, D]` gradient buffer and no capacity
    (nothing can overflow). Ids >= the table's rows are padding, as in the forward. `step`,
    `seed`: as in `sparse_update`.

    Returns `(table, state, num_unique_rows)`; in place when `table`/`state` are donated.
    """
    combiner = Combiner.parse(combiner)
    g = jnp.asarray(output_grads)
    ids, segment_ids, scale = _backward_inputs(
        "lookup_pool_backward_update", table, g.shape[0], ids, segment_ids, weights, combiner
    )
    if not _uses_kernels(backend, g.dtype, table.dtype):
        rows, row_grads = _reference_row_grads(table, g, ids, segment_ids, weights, combiner)
        table, state = optimizer.update(table, state, rows, row_grads, step=step, seed=seed)
        return table, state, jnp.sum((rows >= 0).astype(jnp.int32))
    slot_a, slot_b = kernel_slots(optimizer, state)
    new_table, a, b, num_unique = _ffi.sparse_grad_update(
        table,
        slot_a,
        slot_b,
        g,
        ids,
        segment_ids,
        scale,
        kernel_hparams(optimizer, state, step, seed),
        optimizer.kernel_id,
        combiner is Combiner.NONE,
    )
    return new_table, from_kernel_slots(optimizer, state, a, b), num_unique


def _backward_inputs(name, table, num_out, ids, segment_ids, weights, combiner):
    """`(ids, segment_ids, scale)` of a fused backward whose output gradient has `num_out`
    rows: ids whose gradient scale is 0 (padding, outside the table, a dropped bag) become
    -1."""
    ids, segment_ids = pooling_inputs(name, ids, segment_ids, weights, combiner)
    check_grad_rows(name, num_out, ids, combiner)
    scale = id_scale(ids, segment_ids, num_out, weights, combiner, table.shape[0])
    return jnp.where(scale != 0, ids, -1), segment_ids, scale


def _grad_pieces(name: str, output_grads, width: int) -> tuple[jax.Array, ...]:
    """The output gradient as a tuple of `[S_k, D]` pieces of one dtype (an array: one
    piece); a one-line error for anything else."""
    if hasattr(output_grads, "shape"):
        pieces = (output_grads,)
    elif isinstance(output_grads, list | tuple):
        pieces = tuple(output_grads)
    else:
        raise ValueError(
            f"{name}: output_grads must be an array or a list of [S_k, {width}] arrays, got "
            f"{type(output_grads).__name__}"
        )
    if not pieces:
        raise ValueError(f"{name}: output_grads is empty; one or more [S_k, {width}] expected")
    for k, p in enumerate(pieces):
        if not hasattr(p, "shape") or not jnp.issubdtype(p.dtype, jnp.floating):
            what = f"{p.dtype} array" if hasattr(p, "dtype") else type(p).__name__
            raise ValueError(f"{name}: output_grads piece {k} must be a float array, got a {what}")
    pieces = tuple(jnp.asarray(p) for p in pieces)
    for k, p in enumerate(pieces):
        if p.ndim != 2 or p.shape[1] != width or p.dtype != pieces[0].dtype:
            raise ValueError(
                f"{name}: output_grads piece {k} must be [S_k, {width}] {pieces[0].dtype}, "
                f"got {p.shape} {p.dtype}"
            )
    return pieces


def _reference_row_grads(table, g, ids, segment_ids, weights, combiner):
    """The distinct rows (sorted, -1 padded, one slot per id) and their summed gradients,
    on the reference (also for dtypes the kernels do not take)."""
    return lookup_pool_backward(
        g,
        ids,
        segment_ids,
        weights,
        capacity=min(ids.shape[0], table.shape[0]),
        combiner=combiner,
        vocab_size=table.shape[0],
        backend=Backend.REFERENCE,
    )[:2]


# --- undoable: update, decide, keep or undo ---------------------------------------------


def read_marker(*arrays: jax.Array) -> jax.Array:
    """int32 `[k]`: the bits of one element of each of `arrays` (the outputs of a lookup),
    for `stage_backward_update(after=...)`: a few bytes that make the in-place update wait
    for whatever produced them."""
    parts = [
        jax.lax.bitcast_convert_type(x.reshape(-1)[:1].astype(jnp.float32), jnp.int32)
        for x in arrays
    ]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)


class StagedUpdate(NamedTuple):
    """An update applied in place and still undoable (`stage_backward_update`): the table and
    optimizer state after it, and the previous values of the rows it touched, C = min(N ids,
    V rows) slots, as many as there can be distinct rows. `commit_update` keeps it or writes
    the previous rows back.

    table: the table after the update (the input's buffer: XLA aliases it).
    state: the optimizer state after the update; an update count (Adam's) is advanced by
      `commit_update`, only for a kept update.
    rows: `[C]` the distinct table rows, ascending, -1 after the last.
    values: `[C, D]` their previous weights, in the table's dtype.
    slots: the two kernel slot operands' previous rows, `[C, w]` for a slot of w floats per
      row (`abi::SlotRowWidth`), `[1]` for an unused one (whose value is undefined).
    Rows of `values` and `slots` past the `num_unique` distinct rows are undefined (never
      read: their `rows` entries are -1).
    finite: `[]` bool, every updated weight and slot value is finite.
    num_unique: `[]` int32, distinct ids seen.
    """

    table: jax.Array
    state: Any
    rows: jax.Array
    values: jax.Array
    slots: tuple[jax.Array, jax.Array]
    finite: jax.Array
    num_unique: jax.Array


class Staging(NamedTuple):
    """The memory a staged update saves the previous rows into: `StagedUpdate.values` and
    `.slots` of an earlier update of the same shapes, handed to the next
    (`stage_backward_update(staging=)`)."""

    values: jax.Array
    slot_a: jax.Array
    slot_b: jax.Array

    @classmethod
    def of(cls, staged: StagedUpdate) -> Staging:
        return cls(staged.values, *staged.slots)


def stage_backward_update(
    table: jax.Array,
    state: Any,
    output_grads: jax.Array | Sequence[jax.Array],
    ids: jax.Array,
    segment_ids: jax.Array | None,
    weights: jax.Array | None = None,
    *,
    optimizer: SparseOptimizer,
    combiner: Combiner | str = Combiner.SUM,
    step: jax.Array | int | None = None,
    seed: jax.Array | int | None = None,
    staging: Staging | None = None,
    after: jax.Array | None = None,
    backend: Backend | str | None = None,
) -> StagedUpdate:
    """`lookup_pool_backward_update`, undoable: the rows are updated in place (donate `table`
    and `state`) and their previous values saved; keep or undo it with `commit_update`.
    Arguments as there, except:

    - `table` may be a block `[1, ..., V, D]` with leading axes of size 1 (a `shard_map`
      block `[1, V, D]`; the state's arrays carry the same ones, Adam's count `[1]`):
      updated as it is, XLA aliases it with no copy.
    - `output_grads` may be a sequence of `[S_k, D]` pieces taken as their rows one after the
      other (the CPU kernel reads each where it is: no concatenated copy).
    - `staging`: the arrays of an earlier `StagedUpdate` of the same shapes (`Staging.of`),
      which the kernel saves the previous rows into (their contents are never read; arrays
      of other shapes, made for another batch, are not used). Donated to the jit, they make
      the staging memory last step's instead of fresh pages: the first touch of a fresh page
      is a fault that zeroes it, which costs a step about as much as the update itself. The
      reference backend ignores it.
    - `after`: an int32 array the update must wait for (never read), e.g. `read_marker` of
      a lookup of the same table in the same jit whose outputs the update does not otherwise
      depend on; without it XLA keeps such a lookup and the in-place update apart by copying
      the whole table. The reference backend ignores it (its scatter is XLA's own)."""
    combiner = Combiner.parse(combiner)
    lead = table.ndim - 2
    if lead < 0 or any(n != 1 for n in table.shape[:-2]):
        raise ValueError(
            f"stage_backward_update: table must be [V, D] or a block [1, ..., V, D], got "
            f"{list(table.shape)}"
        )
    if not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(f"stage_backward_update: table must be a float type, got {table.dtype}")
    if staging is not None and not (
        isinstance(staging, tuple | list)
        and len(staging) == 3
        and all(hasattr(x, "shape") for x in staging)
    ):
        raise ValueError(
            "stage_backward_update: staging must be an ops.Staging of 3 arrays (Staging.of), "
            f"got {type(staging).__name__}"
        )
    local_state = jax.tree.map(lambda x: x[(0,) * lead], state) if lead else state
    rows_view = table.reshape(table.shape[-2:]) if lead else table
    pieces = _grad_pieces("stage_backward_update", output_grads, table.shape[-1])
    num_out = sum(p.shape[0] for p in pieces)
    ids, segment_ids, scale = _backward_inputs(
        "stage_backward_update", rows_view, num_out, ids, segment_ids, weights, combiner
    )
    if _uses_kernels(backend, pieces[0].dtype, table.dtype):
        slot_a, slot_b = kernel_slots(optimizer, state)
        hparams = kernel_hparams(optimizer, local_state, step, seed)
        if after is not None:  # ordering operands ride behind the hyper-parameters, never read
            marks = jax.lax.bitcast_convert_type(jnp.asarray(after, jnp.int32), jnp.float32)
            hparams = jnp.concatenate([hparams, marks.reshape(-1)])
        rows, values, sa, sb, num_unique, finite, new_table, a, b = _ffi.sparse_grad_stage(
            table,
            slot_a,
            slot_b,
            pieces,
            ids,
            segment_ids,
            scale,
            hparams,
            optimizer.kernel_id,
            combiner is Combiner.NONE,
            _slot_widths(optimizer, table.shape[-1]),
            staging,
        )
        new_state = from_kernel_slots(optimizer, state, a, b, 0)
        return StagedUpdate(new_table, new_state, rows, values, (sa, sb), finite != 0, num_unique)
    g = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
    rows, row_grads = _reference_row_grads(rows_view, g, ids, segment_ids, weights, combiner)
    return _stage_rows(table, state, local_state, rows, row_grads, optimizer, step, seed)


def _stage_rows(table, state, local_state, rows, row_grads, optimizer, step, seed):
    """The reference stage: the optimizer's math on the gathered rows, scattered in place."""
    lead = (0,) * (table.ndim - 2)
    vocab = table.shape[-2]
    valid = (rows >= 0) & (rows < vocab)
    safe = jnp.where(valid, rows, 0)
    at = (*lead, jnp.where(valid, rows, vocab))
    w_old = table[(*lead, safe)]
    full = optimizer.slot_arrays(state)
    old_slots = tuple(s[(*lead, safe)] for s in full)
    new_w, new_slots = optimizer.rows_update(
        w_old.astype(jnp.float32),
        old_slots,
        row_grads.astype(jnp.float32),
        optimizer.hparams(local_state, step),
    )
    values = stored_values(new_w, table.dtype, rows, seed)
    ok = jnp.all(jnp.isfinite(values.astype(jnp.float32)) | ~valid[:, None])
    for s in new_slots:
        ok &= jnp.all(jnp.isfinite(_per_row(s, rows)) | ~valid[:, None])
    new_table = table.at[at].set(values, mode="drop")
    slots = tuple(f.at[at].set(s, mode="drop") for f, s in zip(full, new_slots, strict=True))
    saved = [_per_row(s, rows) for s in old_slots]
    dummy = jnp.zeros((1,), jnp.float32)
    saved = (*saved, dummy, dummy)[:2]
    rows = jnp.where(valid, rows, -1)
    return StagedUpdate(
        new_table,
        optimizer.advance(state, slots, 0),
        rows,
        w_old,
        saved,
        ok,
        jnp.sum(valid, dtype=jnp.int32),
    )


def _per_row(x: jax.Array, rows: jax.Array) -> jax.Array:
    """`[C, ...]` -> `[C, w]` (also for C = 0, where a -1 in the shape is ambiguous)."""
    return x.reshape(rows.shape[0], math.prod(x.shape[1:]))


def _verdict(commit) -> jax.Array:
    """`commit` as a bool scalar (a bool or integer scalar: nonzero keeps); a one-line error
    naming it otherwise."""
    commit = jnp.asarray(commit)
    if commit.shape != () or not (
        commit.dtype == jnp.bool_ or jnp.issubdtype(commit.dtype, jnp.integer)
    ):
        raise ValueError(
            f"commit_update: commit must be a bool scalar, got {commit.dtype}{list(commit.shape)}"
        )
    return commit.astype(bool)


def commit_update(
    staged: StagedUpdate,
    commit: jax.Array | bool,
    *,
    optimizer: SparseOptimizer,
    backend: Backend | str | None = None,
) -> tuple[jax.Array, Any]:
    """Keeps the update `staged` when `commit` (a bool scalar, may be traced) is true, and
    otherwise writes its saved rows back, in place: returns `(table, state)`, bit-identical to
    the stage's inputs when undone. An optimizer that counts updates (Adam) counts this one
    only when kept."""
    commit = _verdict(commit)
    table = staged.table
    if _uses_kernels(backend, table.dtype):
        slot_a, slot_b = kernel_slots(optimizer, staged.state)
        undo = (~commit).astype(jnp.int32).reshape(1)
        new_table, a, b = _ffi.commit_rows(
            table,
            slot_a,
            slot_b,
            staged.rows,
            staged.values,
            *staged.slots,
            undo,
            optimizer.kernel_id,
        )
        return new_table, from_kernel_slots(optimizer, staged.state, a, b, commit)
    lead = (0,) * (table.ndim - 2)
    vocab = table.shape[-2]
    valid = ~commit & (staged.rows >= 0) & (staged.rows < vocab)
    at = (*lead, jnp.where(valid, staged.rows, vocab))
    new_table = table.at[at].set(staged.values.astype(table.dtype), mode="drop")
    slots = []
    for full, rows in zip(optimizer.slot_arrays(staged.state), staged.slots, strict=False):
        per_row = full.shape[len(lead) + 1 :]
        slots.append(full.at[at].set(rows.reshape(-1, *per_row), mode="drop"))
    return new_table, optimizer.advance(staged.state, tuple(slots), commit)
