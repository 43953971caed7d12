"""Dynamic embedding tables, the kernel layer: one shard's hash table (docs/design.md §11).

A dynamic table (`core.dynamic.DynamicTableConfig`) maps arbitrary 64-bit ids to the rows of
a fixed-capacity shard. Its state, `DynamicTableState`, is a NamedTuple of arrays: the keys
and scores of `num_buckets * bucket_size` slots, the admission candidates, the values
`[C, dim]` (slot e is row e) and their optimizer slots. Two ops, each an FFI kernel (CPU and
CUDA) with a `jnp` reference beside it (`backend="reference"`, `ops.hash_reference`):

- `find(state, ids, config=)` (evaluation): the slot of each id, -1 for ids the table does
  not hold; reads only.
- `find_or_insert(state, ids, step, config=)` (training): the slot of each id, inserting the
  new ones it admits (evicting under the table's policy when their bucket is full) and
  giving each inserted row the initializer's value and fresh optimizer slots. Returns the new
  state and `InsertResult(slots, inserted, counts)`; -1 for ids refused by admission or
  dropped (their lookups read zeros and their gradients are dropped, as padding's). Ids are
  processed in order: the same ids in the same order give the same table, on every backend
  and thread count.

The slots are rows: a lookup is `ops.lookup_pool(state.values, slots, ...)` and the fused
sparse update `ops.lookup_pool_backward_update(state.values, state.opt_state, ..., slots,
...)`, both of which skip -1.

Ids are `[N, 2]` uint32 (low, high) words (`as_key_words` makes them from int32 ids, from
int64 ids under `jax_enable_x64`, or from host int64/uint64 arrays); the all-ones id (int64
-1) is padding. Steps are int32 >= 0 and must not decrease from call to call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax.core.dynamic import DynamicTableConfig, Eviction, key_words
from embark_jax.ops import _ffi, abi, hash_reference
from embark_jax.ops.backend import Backend, resolve
from embark_jax.ops.optimizers import SparseOptimizer
from embark_jax.ops.reference import mix32

__all__ = [
    "DynamicTableState",
    "InsertResult",
    "as_key_words",
    "count_dict",
    "find",
    "find_or_insert",
    "find_or_insert_slots",
    "find_slots",
    "init",
    "initial_rows",
    "occupancy",
]

EMPTY = 0xFFFFFFFF


class DynamicTableState(NamedTuple):
    """One shard of a dynamic table (C = `capacity` slots, B buckets, A candidates each)."""

    keys: jax.Array  # [C, 2] uint32: (lo, hi) id words of each slot; all ones = empty
    scores: jax.Array  # [C, 2] int32: (last step seen, times seen)
    cand_keys: jax.Array  # [B * A, 2] uint32: ids seen but not admitted yet
    cand_scores: jax.Array  # [B * A, 2] int32: (last step seen, times seen)
    values: jax.Array  # [C, dim]: row e belongs to slot e
    opt_state: Any  # the optimizer's state of `values` (its `init(values)`), or ()
    step: jax.Array  # [] int32: the step of the latest find_or_insert (find's "now")


class InsertResult(NamedTuple):
    slots: jax.Array  # [N] int32: each id's slot (= row), -1: padding, refused or dropped
    inserted: jax.Array  # [N] bool: this occurrence inserted its id (a fresh row)
    counts: jax.Array  # [len(abi.HashCount)] int32: per-call counts (`count_dict`)


def init(config: DynamicTableConfig, *, optimizer: SparseOptimizer | None = None):
    """An empty shard of `config`'s table: no ids, zero values, the optimizer's fresh state
    (`optimizer.init(values)`; none without an optimizer), step 0."""
    if not isinstance(config, DynamicTableConfig):
        raise ValueError(f"init: config must be a DynamicTableConfig, got {type(config).__name__}")
    c, a = config.capacity, config.num_buckets * config.admission_candidates
    values = jnp.zeros((c, config.dim), config.dtype)
    return DynamicTableState(
        keys=jnp.full((c, 2), EMPTY, jnp.uint32),
        scores=jnp.zeros((c, 2), jnp.int32),
        cand_keys=jnp.full((a, 2), EMPTY, jnp.uint32),
        cand_scores=jnp.zeros((a, 2), jnp.int32),
        values=values,
        opt_state=() if optimizer is None else optimizer.init(values),
        step=jnp.zeros((), jnp.int32),
    )


def as_key_words(ids: Any, name: str = "ids") -> jax.Array:
    """`[N, 2]` uint32 (lo, hi) words of 64-bit ids.

    Takes `[N, 2]` uint32 words as they are; `[N]` int64 or uint64 ids (device arrays exist
    only under `jax_enable_x64`; host arrays always); narrower integer ids, signed ones
    sign-extended (an int32 -1 is the padding id) and unsigned ones zero-extended. Host
    arrays and lists are converted on the host (`core.dynamic.key_words`).
    """
    if not isinstance(ids, jax.Array):
        try:
            return jnp.asarray(key_words(ids))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    if ids.dtype == jnp.uint32 and ids.ndim == 2 and ids.shape[1] == 2:
        return ids
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"{name}: dynamic ids must be [N] integers or [N, 2] uint32 words, got "
            f"{ids.dtype} of shape {ids.shape}"
        )
    if ids.dtype.itemsize == 8:
        lo = (ids & 0xFFFFFFFF).astype(jnp.uint32)
        hi = (ids >> 32).astype(jnp.uint32)
    elif jnp.issubdtype(ids.dtype, jnp.signedinteger):
        x = ids.astype(jnp.int32)
        lo = jax.lax.bitcast_convert_type(x, jnp.uint32)
        hi = jnp.where(x < 0, jnp.uint32(EMPTY), jnp.uint32(0))
    else:
        lo = ids.astype(jnp.uint32)
        hi = jnp.zeros_like(lo)
    return jnp.stack([lo, hi], axis=1)


def _step(name: str, step) -> jax.Array:
    """The int32 step scalar; a host value is checked to be in [0, 2**31)."""
    if isinstance(step, bool | np.bool_):
        raise ValueError(f"{name}: step must be an int in [0, 2**31), got {step!r}")
    if isinstance(step, int | np.integer | np.ndarray):
        arr = np.asarray(step)
        if arr.shape != () or arr.dtype.kind not in "iu" or not 0 <= int(arr) < 2**31:
            raise ValueError(f"{name}: step must be an int in [0, 2**31), got {step!r}")
        return jnp.asarray(int(arr), jnp.int32)
    step = jnp.asarray(step)
    if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise ValueError(f"{name}: step must be an integer scalar, got {step.dtype}{step.shape}")
    return step.astype(jnp.int32)


def _lead(state: DynamicTableState) -> tuple[int, ...]:
    """The state's leading dimensions: () for a shard, (1,) for a `shard_map` block of a
    stacked table (updated as it is: a reshape would make XLA copy the aliased buffers)."""
    return tuple(state.keys.shape[:-2])


def _check_state(name: str, state: DynamicTableState, config: DynamicTableConfig) -> None:
    if not isinstance(config, DynamicTableConfig):
        raise ValueError(f"{name}: config must be a DynamicTableConfig, got {config!r}")
    lead = _lead(state)
    if lead not in ((), (1,)):
        raise ValueError(
            f"{name}: state.keys must be [C, 2] or a [1, C, 2] block, got {list(state.keys.shape)}"
        )
    c, a = config.capacity, config.num_buckets * config.admission_candidates
    want = {
        "keys": ((*lead, c, 2), jnp.uint32),
        "scores": ((*lead, c, 2), jnp.int32),
        "cand_keys": ((*lead, a, 2), jnp.uint32),
        "cand_scores": ((*lead, a, 2), jnp.int32),
        "values": ((*lead, c, config.dim), config.dtype),
    }
    for field, (shape, dtype) in want.items():
        x = getattr(state, field)
        if tuple(x.shape) != shape or x.dtype != jnp.dtype(dtype):
            raise ValueError(
                f"{name}: state.{field} must be {jnp.dtype(dtype)}{list(shape)} for dynamic "
                f"table {config.name!r}, got {x.dtype}{list(x.shape)}"
            )


def find_slots(
    keys: jax.Array,
    scores: jax.Array,
    ids: jax.Array,
    step: jax.Array,
    *,
    bucket_size: int,
    ttl: int = 0,
    backend: Backend | str | None = None,
) -> jax.Array:
    """The raw `find`: `[N]` int32 slot of each id of `ids` `[N, 2]` uint32, -1 if absent or
    expired (`ttl` > 0 and `step - last seen > ttl`)."""
    step = jnp.asarray(step, jnp.int32)
    if resolve(backend) is Backend.REFERENCE:
        keys, scores = keys.reshape(-1, 2), scores.reshape(-1, 2)
        return hash_reference.find(keys, scores, ids, step, bucket_size=bucket_size, ttl=ttl)
    return _ffi._call(abi.Target.HASH_FIND, _ffi.result_type(ids, (ids.shape[0],), jnp.int32))(
        keys, scores, ids, step, bucket_size=np.int64(bucket_size), ttl=np.int64(ttl)
    )


def find_or_insert_slots(
    keys: jax.Array,
    scores: jax.Array,
    cand_keys: jax.Array,
    cand_scores: jax.Array,
    ids: jax.Array,
    step: jax.Array,
    *,
    bucket_size: int,
    eviction: Eviction | str = Eviction.LRU,
    threshold: int = 1,
    ttl: int = 0,
    backend: Backend | str | None = None,
):
    """The raw `find_or_insert` on the hash table's arrays (no values): returns `(keys,
    scores, cand_keys, cand_scores, slots [N] int32, fresh [N] bool, counts [6] int32)`.
    The first four are updated in place when donated (the kernel's outputs alias them);
    they may carry leading dimensions (`[..., C, 2]`), which count as rows."""
    eviction_id = abi.EvictionId[Eviction.parse(eviction).name]
    step = jnp.asarray(step, jnp.int32)
    attrs = dict(bucket_size=bucket_size, eviction=int(eviction_id), threshold=threshold, ttl=ttl)
    if resolve(backend) is Backend.REFERENCE:
        shapes = (keys.shape, scores.shape, cand_keys.shape, cand_scores.shape)
        flat = tuple(x.reshape(-1, 2) for x in (keys, scores, cand_keys, cand_scores))
        out = hash_reference.find_or_insert(flat, ids, step, **attrs)
        return tuple(x.reshape(s) for x, s in zip(out[:4], shapes, strict=True)) + tuple(out[4:])
    n = ids.shape[0]
    ws = 1
    if _ffi.on_gpu():
        from embark_jax import _ffi_cuda

        ws = _ffi_cuda.hash_table_workspace_bytes(n)
    out = _ffi._call(
        abi.Target.HASH_FIND_OR_INSERT,
        (
            _ffi.result_type(keys, keys.shape, jnp.uint32),
            _ffi.result_type(scores, scores.shape, jnp.int32),
            _ffi.result_type(cand_keys, cand_keys.shape, jnp.uint32),
            _ffi.result_type(cand_scores, cand_scores.shape, jnp.int32),
            _ffi.result_type(ids, (n,), jnp.int32),
            _ffi.result_type(ids, (n,), jnp.bool_),
            _ffi.result_type(ids, (len(abi.HashCount),), jnp.int32),
            _ffi._workspace(ids, ws),
        ),
        input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3},
    )(keys, scores, cand_keys, cand_scores, ids, step, **{k: np.int64(v) for k, v in attrs.items()})
    return tuple(out[:7])


def find(
    state: DynamicTableState,
    ids: Any,
    *,
    config: DynamicTableConfig,
    backend: Backend | str | None = None,
) -> jax.Array:
    """`[N]` int32: the slot (= row of `state.values`) of each id, -1 for ids the table does
    not hold (never inserted, refused, evicted, or expired at `state.step`) and padding.
    Changes nothing: for evaluation, where unknown ids read zeros (`lookup_pool` skips -1)."""
    _check_state("find", state, config)
    words = as_key_words(ids, "find: ids")
    return find_slots(
        state.keys,
        state.scores,
        words,
        state.step,
        bucket_size=config.bucket_size,
        ttl=config.ttl,
        backend=backend,
    )


def find_or_insert(
    state: DynamicTableState,
    ids: Any,
    step: Any,
    *,
    config: DynamicTableConfig,
    optimizer: SparseOptimizer | None = None,
    backend: Backend | str | None = None,
) -> tuple[DynamicTableState, InsertResult]:
    """The slot of each id, inserting the ids the table admits (training).

    Ids are processed in order (docs/design.md §11): a held id is found (its score
    refreshed); a new one is counted towards admission and, once admitted, takes the first
    free slot of its bucket, else replaces the entry the eviction policy picks among those
    not seen in this step, else is dropped. Each inserted row gets `initial_rows` and its
    optimizer slots the optimizer's initial values (pass the `optimizer` whose state
    `state.opt_state` is; required when it has slots).

    Arguments:
      state: the shard (`init`); updated in place when donated.
      ids: `[N, 2]` uint32 words or integer ids (`as_key_words`).
      step: int32 >= 0, the training step; must not decrease from call to call. Entries
        seen at this step are never evicted, so every slot returned in a step stays valid
        for the whole step (several calls may share a step).

    Returns `(state, InsertResult(slots, inserted, counts))`; `count_dict(counts)` names the
    counts (found, inserted, evicted, expired, refused, dropped).
    """
    _check_state("find_or_insert", state, config)
    words = as_key_words(ids, "find_or_insert: ids")
    step = _step("find_or_insert", step)
    keys, scores, ckeys, cscores, slots, fresh, counts = find_or_insert_slots(
        state.keys,
        state.scores,
        state.cand_keys,
        state.cand_scores,
        words,
        step,
        bucket_size=config.bucket_size,
        eviction=config.eviction,
        threshold=config.admission_threshold,
        ttl=config.ttl,
        backend=backend,
    )
    c, lead = config.capacity, _lead(state)
    rows = jnp.where(fresh, slots, c)  # rows to reset; c is out of range: dropped
    at = (0,) * len(lead) + (rows,)  # a block is written as it is (no reshape: no copy)
    values = state.values.at[at].set(initial_rows(config, words), mode="drop")
    opt_state = _reset_slots(state.opt_state, at, c, config, optimizer)
    step = jnp.broadcast_to(step, jnp.shape(state.step))
    new = DynamicTableState(keys, scores, ckeys, cscores, values, opt_state, step)
    return new, InsertResult(slots, fresh, counts)


def _reset_slots(opt_state, at, capacity: int, config, optimizer):
    """The optimizer state with the rows at index `at` (`(rows,)`, or `(0, rows)` in a
    block) reset to the optimizer's initial values."""
    per_row = [x for x in jax.tree.leaves(opt_state) if x.ndim > 0]
    if not per_row:
        return opt_state
    if optimizer is None:
        raise ValueError(
            "find_or_insert: state.opt_state has optimizer slots; pass the optimizer that "
            "made them (optimizer=) so that inserted rows get fresh slots"
        )
    fresh = optimizer.init(jnp.zeros((1, config.dim), config.dtype))

    lead, rows = len(at) - 1, at[-1]

    def reset(x, x0):
        if x.ndim <= lead or x.shape[lead] != capacity:
            return x  # e.g. Adam's update count
        fill = jnp.broadcast_to(x0[0], (rows.shape[0], *x.shape[lead + 1 :]))
        return x.at[at].set(fill, mode="drop")

    return jax.tree.map(reset, opt_state, fresh)


def initial_rows(config: DynamicTableConfig, words: jax.Array) -> jax.Array:
    """`[N, dim]` rows the initializer gives the ids `words` `[N, 2]` uint32: zeros, or
    uniform in `[-scale, scale)` from a hash of (seed, id, column), so that a row depends on
    its id only (not on the slot, the batch or the backend)."""
    n, d = words.shape[0], config.dim
    if config.initializer == "zeros":
        return jnp.zeros((n, d), config.dtype)
    h = mix32(jnp.uint32(config.seed) ^ jnp.uint32(0x632BE5AB))
    h = mix32(mix32(h ^ words[:, 0]) ^ words[:, 1])
    bits = mix32(h[:, None] ^ jnp.arange(d, dtype=jnp.uint32)[None, :])
    u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)  # [0, 1), exact
    return ((2.0 * u - 1.0) * jnp.float32(config.scale)).astype(config.dtype)


def count_dict(counts: Any) -> dict[str, int]:
    """The per-call counts of `find_or_insert` by name (`abi.HashCount`, lower case)."""
    arr = np.asarray(counts)
    return {c.name.lower(): int(arr[c]) for c in abi.HashCount}


def occupancy(state: DynamicTableState, config: DynamicTableConfig) -> jax.Array:
    """`[]` int32: slots holding a live entry at `state.step` (for load factors)."""
    empty = jnp.uint32(EMPTY)
    occupied = ~((state.keys[:, 0] == empty) & (state.keys[:, 1] == empty))
    if config.ttl:
        occupied &= (state.step - state.scores[:, 0]) <= config.ttl
    return jnp.sum(occupied.astype(jnp.int32))
