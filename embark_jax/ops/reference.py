"""Pure-JAX reference semantics of every embark_jax op: the ground truth the kernels and the
distributed clusters are tested against. Differentiable with plain `jax.grad`.

Conventions shared by all ops:
  * ids < 0 are padding and contribute nothing; ids >= the table's rows are treated the same
    way (inputs are validated on the host before they get here, see `SparseFeatures`).
  * segment ids outside [0, num_segments) are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embark_jax.core.specs import Combiner

__all__ = [
    "lookup_pool",
    "mix32",
    "pool_denominator",
    "rounding_bits",
    "segment_sum",
    "stochastic_round_bf16",
    "unique",
]


def segment_sum(values: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """`out[s] = sum(values[i] for i with segment_ids[i] == s)`; values `[N, ...]`."""
    seg = jnp.asarray(segment_ids)
    valid = (seg >= 0) & (seg < num_segments)
    seg = jnp.where(valid, seg, num_segments)  # out-of-range bucket, dropped below
    out = jax.ops.segment_sum(values, seg, num_segments=num_segments + 1)
    return out[:num_segments]


def pool_denominator(
    ids: jax.Array,
    segment_ids: jax.Array,
    num_segments: int,
    weights: jax.Array | None,
    combiner: Combiner | str,
) -> jax.Array:
    """Per-segment divisor of a pooled combiner, `[num_segments]` float32: 1 for `sum`,
    sum of weights for `mean`, sqrt of the sum of squared weights for `sqrtn`, over the
    non-padding ids (unweighted: the count and its square root)."""
    combiner = Combiner.parse(combiner)
    valid = ids >= 0
    w = jnp.ones(ids.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    w = jnp.where(valid, w, 0.0)
    if combiner is Combiner.SUM:
        return jnp.ones((num_segments,), jnp.float32)
    if combiner is Combiner.MEAN:
        return segment_sum(w, segment_ids, num_segments)
    if combiner is Combiner.SQRTN:
        sq = segment_sum(w * w, segment_ids, num_segments)
        # sqrt's derivative at 0 is infinite: a bag of zero weights would get NaN gradients
        return jnp.where(sq > 0, jnp.sqrt(jnp.where(sq > 0, sq, 1.0)), 0.0)
    raise ValueError(f"combiner {combiner.value!r} does not pool")


def lookup_pool(
    table: jax.Array,
    ids: jax.Array,
    segment_ids: jax.Array | None,
    num_segments: int,
    weights: jax.Array | None = None,
    combiner: Combiner | str = Combiner.SUM,
) -> jax.Array:
    """Gather rows of `table` `[V, D]` for `ids` `[N]` and pool them per segment.

    Returns `[num_segments, D]` for `sum`/`mean`/`sqrtn` (empty bags give zeros) and
    `[N, D]` for `none` (one row per id, zeros at padding; `segment_ids` and `num_segments`
    are ignored). `weights` `[N]` scales each id's row. Output dtype is the table's.
    """
    combiner = Combiner.parse(combiner)
    vocab = table.shape[0]
    valid = (ids >= 0) & (ids < vocab)
    safe = jnp.where(valid, ids, 0)
    if vocab == 0:  # every id is padding (take cannot index an empty axis)
        rows = jnp.zeros((ids.shape[0], table.shape[1]), jnp.float32)
    else:
        rows = jnp.take(table, safe, axis=0).astype(jnp.float32)
        rows = jnp.where(valid[:, None], rows, 0.0)  # a padding id reads no row (not row 0)
    w = jnp.ones(ids.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    w = jnp.where(valid, w, 0.0)
    rows = rows * w[:, None]
    if combiner is Combiner.NONE:
        return rows.astype(table.dtype)
    pooled = segment_sum(rows, segment_ids, num_segments)
    if combiner is not Combiner.SUM:
        denom = pool_denominator(
            jnp.where(valid, ids, -1), segment_ids, num_segments, weights, combiner
        )
        # Scaled as the kernels scale: a bag whose divisor is not positive (or NaN) gets a
        # scale of 0, so its finite sums give 0 and a NaN or inf weight still shows as NaN.
        scale = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)
        pooled = pooled * scale[:, None]
    return pooled.astype(table.dtype)


def unique(ids: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sorted unique non-negative ids of `ids` `[N]`, in a fixed capacity.

    Returns `(unique_ids [capacity], inverse [N], counts [capacity], num_unique [])`:
    `unique_ids` ascending, padded with -1; `inverse[i]` is the slot of `ids[i]` (-1 for
    padding ids and for ids whose slot is past `capacity`); `counts` the occurrences of
    each unique id; `num_unique` the true number of distinct ids, so
    `max(num_unique - capacity, 0)` ids did not fit (an overflow to report, never to hide).
    """
    ids = jnp.asarray(ids)
    n = ids.shape[0]
    valid = ids >= 0
    key = jnp.where(valid, ids, 0)
    # Padding last whatever the valid ids are (the dtype's largest value is an id too: a
    # sentinel key of iinfo.max dropped it); stable, so equal ids keep their order.
    order = jnp.lexsort((key, ~valid))
    sorted_ids = key[order]
    valid_sorted = valid[order]
    is_new = (
        jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
        if n
        else (jnp.zeros((0,), bool))
    )
    is_new = is_new & valid_sorted
    slot_sorted = jnp.cumsum(is_new.astype(jnp.int32)) - 1
    num_unique = jnp.sum(is_new, dtype=jnp.int32)  # int32 with 64-bit types on too, as the kernels
    in_cap = valid_sorted & (slot_sorted < capacity)
    slot_sorted = jnp.where(in_cap, slot_sorted, -1)
    target = jnp.where(is_new & in_cap, slot_sorted, capacity)
    unique_ids = jnp.full((capacity + 1,), -1, ids.dtype).at[target].set(sorted_ids)[:capacity]
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(slot_sorted)
    counts = segment_sum(jnp.ones((n,), jnp.int32), slot_sorted, capacity)
    return unique_ids, inverse, counts, num_unique


def mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash (Wellons' "lowbias32", `abi::Mix32`), elementwise on uint32."""
    x = jnp.asarray(x).astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def rounding_bits(seed: jax.Array, rows: jax.Array, dim: int) -> jax.Array:
    """`[C, dim]` uint32: the random bits of element `(rows[c], j)` under `seed` (a uint32
    scalar), a counter-based hash of (seed, row, column) (`abi::RowKey`, `abi::ElementBits`):
    independent of how the work is split, so kernels and this reference agree bit for bit."""
    rows = jnp.asarray(rows)
    lo = rows.astype(jnp.uint32)
    if rows.dtype.itemsize == 8:
        hi = (rows >> 32).astype(jnp.uint32)
    else:  # an int32 row's upper word: its sign extension
        hi = jnp.where(rows < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
    h = mix32(jnp.asarray(seed).astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
    h = mix32(mix32(h ^ lo) ^ hi)
    return mix32(h[:, None] ^ jnp.arange(dim, dtype=jnp.uint32)[None, :])


def stochastic_round_bf16(values: jax.Array, seed: jax.Array, rows: jax.Array) -> jax.Array:
    """`values` `[C, D]` (float32) stored as bfloat16 with stochastic rounding: the upper 16
    of `rounding_bits(seed, rows, D)` are added below the bfloat16 mantissa and the low 16
    bits dropped (`abi::StochasticBf16`). A value between two bfloat16 numbers becomes the
    upper one (in magnitude) with probability equal to its distance from the lower one in
    units of their gap, so the expected stored value is the value itself: small updates
    are kept on average instead of being rounded away. NaN stays NaN."""
    x = jnp.asarray(values, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    r = rounding_bits(seed, rows, x.shape[1]) >> 16
    out = jax.lax.bitcast_convert_type(((bits + r) >> 16).astype(jnp.uint16), jnp.bfloat16)
    return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), out)
