"""`lookup_pool` (fused gather + pooling), its sparse backward, and `unique`."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax.core.specs import Combiner
from embark_jax.ops import _ffi, reference
from embark_jax.ops.backend import Backend, resolve
from embark_jax.ops.ids import as_ids

__all__ = ["lookup_pool", "lookup_pool_backward", "unique"]

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check_count(name: str, value) -> int:
    """`value` as an int >= 0 (a Python or numpy int, or a concrete 0-d integer array)."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return n


def lookup_pool(
    table: jax.Array,
    ids: jax.Array,
    segment_ids: jax.Array | None,
    num_segments: int,
    weights: jax.Array | None = None,
    combiner: Combiner | str = Combiner.SUM,
    *,
    out_dtype=None,
    indices_are_sorted: bool = False,
    split: Sequence[int] | None = None,
    backend: Backend | str | None = None,
) -> jax.Array | tuple[jax.Array, ...]:
    """Fused gather + weighted pooling; see `reference.lookup_pool` for the semantics.

    Arguments:
      table: `[V, D]` float32 or bfloat16 (the kernels; other float types, e.g. float16 or
        float64, run on the `jnp` reference).
      ids: `[N]` int32/int64 (narrower integer types are widened: `ops.ids`); ids outside
        `[0, V)` are padding.
      segment_ids: `[N]` bag of each id (sorted ascending is fastest); ignored for `none`.
        An id whose bag is outside `[0, S)` is dropped, as padding is (no output, no
        gradient): shape checks only, since a value check would need the values on the host.
      num_segments: number of bags S (an int >= 0).
      weights: optional `[N]` per-id weights.
      combiner: `sum`, `mean`, `sqrtn` (output `[S, D]`) or `none` (output `[N, D]`).
      out_dtype: output dtype (default: the table's), a float type (the kernels: float32 or
        bfloat16).
      indices_are_sorted: a performance hint that `segment_ids` are ascending (true for
        `SparseFeatures.flat`): the CUDA kernel then builds bag offsets and pools a bag per
        warp without atomics. Both backends check the order themselves (O(N)), so unsorted
        ids with the hint set still give the right result, on the slower path.
      split: row counts that sum to the output's rows: the output as a tuple of consecutive
        `[split[k], D]` pieces (e.g. one per feature of a stacked group). The CPU kernel
        writes each piece where it is, with no sliced copy of one output.

    Differentiable wrt `table` (a dense gradient: for small tables and tests; training uses
    `lookup_pool_backward`) and `weights`.
    """
    combiner = Combiner.parse(combiner)
    num_segments = _check_count("lookup_pool: num_segments", num_segments)
    table = jnp.asarray(table)
    if table.ndim != 2:
        raise ValueError(f"lookup_pool: table must be [V, D], got shape {table.shape}")
    ids, segment_ids = pooling_inputs("lookup_pool", ids, segment_ids, weights, combiner)
    out_dtype = jnp.dtype(out_dtype or table.dtype)
    split = _check_split(split, ids.shape[0] if combiner is Combiner.NONE else num_segments)
    for what, dt in (("table", table.dtype), ("out_dtype", out_dtype)):
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"lookup_pool: {what} must be a float type, got {dt}")
    use_ffi = (
        resolve(backend) is Backend.FFI
        and table.dtype in _FLOAT_DTYPES
        and out_dtype in _FLOAT_DTYPES
    )
    if not use_ffi:
        out = reference.lookup_pool(table, ids, segment_ids, num_segments, weights, combiner)
        out = out.astype(out_dtype)
        return out if split is None else tuple(jnp.split(out, np.cumsum(split)[:-1].tolist()))
    if weights is None:  # [0]: the kernels take every weight as 1 (nothing to fill or read)
        w = jnp.zeros((0,), jnp.float32)
    else:
        w = jnp.asarray(weights, jnp.float32)
    return _lookup_pool_ffi(
        table,
        ids,
        segment_ids,
        w,
        num_segments,
        combiner.value,
        out_dtype,
        indices_are_sorted,
        split,
    )


def _check_split(split, rows: int) -> tuple[int, ...] | None:
    """`split` as a tuple of ints >= 0 summing to `rows`; a one-line error otherwise."""
    if split is None:
        return None
    try:
        out = tuple(operator.index(k) for k in split)
    except TypeError:
        out = None
    if out is None or not out or min(out) < 0 or sum(out) != rows:
        raise ValueError(
            f"lookup_pool: split must be row counts >= 0 summing to the output's {rows} rows, "
            f"got {split!r}"
        )
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _lookup_pool_ffi(
    table, ids, segment_ids, weights, num_segments, combiner, out_dtype, srt, split
):
    num_out = ids.shape[0] if combiner == "none" else num_segments
    return _ffi.lookup_pool(
        table, ids, segment_ids, weights, num_out, combiner, out_dtype, srt, split
    )


def _lp_fwd(table, ids, segment_ids, weights, num_segments, combiner, out_dtype, srt, split):
    out = _lookup_pool_ffi(
        table, ids, segment_ids, weights, num_segments, combiner, out_dtype, srt, split
    )
    return out, (table, ids, segment_ids, weights)


def _lp_bwd(num_segments, combiner, out_dtype, srt, split, res, g):
    # The dense-gradient path (jax.grad, small tables): the reference's VJP is the ground
    # truth. Training never comes here; it uses lookup_pool_backward + sparse_update.
    table, ids, segment_ids, weights = res
    unweighted = weights.shape != ids.shape  # the [0] form: its cotangent is [0] zeros
    _, vjp = jax.vjp(
        lambda t, w: reference.lookup_pool(
            t, ids, segment_ids, num_segments, None if unweighted else w, combiner
        ),
        table,
        weights,
    )
    if split is not None:
        g = jnp.concatenate(g)
    gt, gw = vjp(g.astype(table.dtype))
    return gt, None, None, gw


_lookup_pool_ffi.defvjp(_lp_fwd, _lp_bwd)


def id_scale(ids, segment_ids, num_segments, weights, combiner, vocab_size):
    """Per-id factor d(output)/d(row): w_i / denom(bag_i); 0 for a padding id and for an id
    whose segment is outside [0, num_segments) (the forward drops it)."""
    valid = ids >= 0
    if vocab_size is not None:
        valid &= ids < vocab_size
    w = jnp.ones(ids.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    w = jnp.where(valid, w, 0.0)
    seg_ok = (segment_ids >= 0) & (segment_ids < num_segments)
    if combiner in (Combiner.SUM, Combiner.NONE):
        return jnp.where(seg_ok, w, 0.0)
    denom = reference.pool_denominator(
        jnp.where(valid, ids, -1), segment_ids, num_segments, w, combiner
    )
    d = jnp.take(denom, jnp.where(seg_ok, segment_ids, 0))
    return jnp.where(seg_ok & (d > 0), w / jnp.where(d > 0, d, 1.0), 0.0)


def pooling_inputs(name: str, ids, segment_ids, weights, combiner: Combiner):
    """An op's `(ids, segment_ids)` as `as_ids` takes them, its weights' length checked
    (`name`: the op). Segment ids are required for pooled combiners and ignored for `none`,
    where each id is its own bag (given as `arange(N)`)."""
    ids = as_ids(f"{name}: ids", ids)
    if not combiner.pooled:
        segment_ids = jnp.arange(ids.shape[0], dtype=jnp.int32)
    elif segment_ids is None:
        raise ValueError(f"{name}: segment_ids are required for pooled combiners")
    segment_ids = as_ids(f"{name}: segment_ids", segment_ids, ids.shape[0])
    _check_weights(name, weights, ids)
    return ids, segment_ids


def _check_weights(name: str, weights, ids) -> None:
    if weights is not None and jnp.shape(weights) != ids.shape:
        raise ValueError(f"{name}: weights must be [N] = {ids.shape}, got {jnp.shape(weights)}")


def check_grad_rows(name: str, num_out: int, ids: jax.Array, combiner: Combiner) -> None:
    """With `combiner="none"` the output gradient has a row per id: a one-line error naming
    both counts when it has not (a missing row would drop an id's gradient silently)."""
    if combiner is Combiner.NONE and num_out != ids.shape[0]:
        raise ValueError(
            f"{name}: combiner 'none' needs an output gradient row per id: got {num_out} rows "
            f"for {ids.shape[0]} ids"
        )


def lookup_pool_backward(
    output_grads: jax.Array,
    ids: jax.Array,
    segment_ids: jax.Array | None,
    weights: jax.Array | None = None,
    *,
    capacity: int,
    combiner: Combiner | str = Combiner.SUM,
    vocab_size: int | None = None,
    backend: Backend | str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sparse gradient of `lookup_pool` wrt the table, without a dense `[V, D]` array.

    Arguments:
      output_grads: `[S, D]` (pooled) or `[N, D]` (`none`) gradient of the lookup's output.
      ids, segment_ids, weights, combiner: as given to `lookup_pool`.
      capacity: static number of unique-row slots C.
      vocab_size: if given, ids >= it are padding (as in the forward).

    Returns `(unique_rows [C], row_grads [C, D] float32, overflow [] int32)`: the distinct
    rows (sorted, -1 padded), the summed gradient of each, and how many distinct rows did not
    fit in `capacity` (their gradient is dropped; report it, never ignore it).
    Feed the result to `sparse_update`.
    """
    combiner = Combiner.parse(combiner)
    ids, segment_ids = pooling_inputs("lookup_pool_backward", ids, segment_ids, weights, combiner)
    g = jnp.asarray(output_grads)
    per_id = combiner is Combiner.NONE
    num_segments = g.shape[0]
    check_grad_rows("lookup_pool_backward", num_segments, ids, combiner)
    scale = id_scale(ids, segment_ids, num_segments, weights, combiner, vocab_size)
    masked_ids = jnp.where(scale != 0, ids, -1) if vocab_size is not None else ids
    if resolve(backend) is Backend.REFERENCE or g.dtype not in _FLOAT_DTYPES:
        rows, inverse, _, num_unique = reference.unique(masked_ids, capacity)
        if num_segments:
            src = jnp.take(g.astype(jnp.float32), jnp.clip(segment_ids, 0, num_segments - 1), 0)
        else:  # no bags: every id's segment is outside, its scale 0
            src = jnp.zeros((ids.shape[0], g.shape[1]), jnp.float32)
        row_grads = reference.segment_sum(src * scale[:, None], inverse, capacity)
    else:
        rows, row_grads, num_unique = _ffi.sparse_grad(
            g, masked_ids, segment_ids, scale, capacity, per_id
        )
    return rows, row_grads, jnp.maximum(num_unique - capacity, 0).astype(jnp.int32)


def unique(
    ids: jax.Array, capacity: int, *, backend: Backend | str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Dedup with inverse index and counts; see `reference.unique` (overflow =
    `max(num_unique - capacity, 0)`)."""
    ids = as_ids("unique: ids", ids)
    if resolve(backend) is Backend.REFERENCE:
        return reference.unique(ids, capacity)
    return _ffi.unique(ids, capacity)
