"""The `jnp` reference of the dynamic tables' hash table kernels (docs/design.md §11).

The ground truth of `embark_hash_find` and `embark_hash_find_or_insert`, written from the
rules in `xla_ffi/include/embark_hash_table.h` (which the CPU and CUDA kernels share) and
checked against both kernels bit for bit, and against a pure-Python model of the table
(`tests/hash_table_model.py`). `find` is vectorised; `find_or_insert` is a `lax.fori_loop`
over the ids, one at a time, as the rules are stated: slow for large batches (use the
kernels), exact by construction.

Only uint32 and int32 arithmetic: nothing here needs JAX's 64-bit types.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embark_jax.ops import abi
from embark_jax.ops.reference import mix32

__all__ = ["bucket_of", "find", "find_or_insert", "hash_words", "shard_of"]

EMPTY = 0xFFFFFFFF
_MAX_COUNT = 0x7FFFFFFF


def hash_words(words: jax.Array) -> jax.Array:
    """`[N, 2]` uint32 hash of `[N, 2]` uint32 (lo, hi) id words (`abi::HashKey`): a 4-round
    Feistel network `(l, r) <- (r, l ^ mix32(r ^ key_i))` from (lo, hi)."""
    words = jnp.asarray(words, jnp.uint32)
    left, right = words[:, 0], words[:, 1]
    for k in abi.HASH_ROUND_KEYS:
        left, right = right, left ^ mix32(right ^ jnp.uint32(k))
    return jnp.stack([left, right], axis=1)


def bucket_of(words: jax.Array, num_buckets: int) -> jax.Array:
    """`[N]` int32 bucket of each id: word 0 of its hash modulo `num_buckets`."""
    return (hash_words(words)[:, 0] % jnp.uint32(num_buckets)).astype(jnp.int32)


def shard_of(words: jax.Array, num_shards: int) -> jax.Array:
    """`[N]` int32 shard owning each id (`core.dynamic.shard_of`): hash word 1 modulo shards."""
    return (hash_words(words)[:, 1] % jnp.uint32(num_shards)).astype(jnp.int32)


def _is_empty(words: jax.Array) -> jax.Array:
    return (words[..., 0] == jnp.uint32(EMPTY)) & (words[..., 1] == jnp.uint32(EMPTY))


def _unexpired(last: jax.Array, step: jax.Array, ttl: int) -> jax.Array:
    if ttl <= 0:
        return jnp.ones(last.shape, bool)
    return (step - last) <= ttl  # steps are >= 0: no int32 overflow


def _sat_inc(x: jax.Array) -> jax.Array:
    return jnp.where(x < _MAX_COUNT, x + 1, x)


def _first_min(mask: jax.Array, *keys: jax.Array) -> jax.Array:
    """Position of the lexicographically smallest `keys` among `mask` (lowest position on a
    tie); meaningless when `mask` is all False."""
    for k in keys:
        smallest = jnp.min(jnp.where(mask, k, jnp.iinfo(k.dtype).max))
        mask = mask & (k == smallest)
    return jnp.argmax(mask)


def find(
    keys: jax.Array,
    scores: jax.Array,
    ids: jax.Array,
    step: jax.Array,
    *,
    bucket_size: int,
    ttl: int,
) -> jax.Array:
    """`[N]` int32: the slot holding each id's live entry, or -1 (absent, expired, padding).

    A bucket's occupied slots are a prefix; the scan stops at its first empty slot."""
    s = bucket_size
    b = bucket_of(ids, keys.shape[0] // s)
    idx = b[:, None] * s + jnp.arange(s, dtype=jnp.int32)[None, :]
    k = keys[idx]  # [N, S, 2]
    empty = _is_empty(k)
    before_empty = jnp.cumsum(empty, axis=1) == 0
    match = (
        (k[..., 0] == ids[:, None, 0])
        & (k[..., 1] == ids[:, None, 1])
        & before_empty
        & _unexpired(scores[idx, 0], step, ttl)
    )
    found = jnp.any(match, axis=1) & ~_is_empty(ids)
    return jnp.where(found, idx[jnp.arange(ids.shape[0]), jnp.argmax(match, axis=1)], -1)


def find_or_insert(
    arrays: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    ids: jax.Array,
    step: jax.Array,
    *,
    bucket_size: int,
    eviction: int,
    threshold: int,
    ttl: int,
):
    """The ids one at a time, in order (embark_hash_table.h states the rules). `arrays`:
    the table's `(keys, scores, cand_keys, cand_scores)`, each `[rows, 2]`.

    Returns `(keys, scores, cand_keys, cand_scores, slots [N] int32, fresh [N] bool,
    counts [len(abi.HashCount)] int32)`."""
    keys, scores, cand_keys, cand_scores = arrays
    s = bucket_size
    num_buckets = keys.shape[0] // s
    a = cand_keys.shape[0] // num_buckets
    n = ids.shape[0]
    step = jnp.asarray(step, jnp.int32)
    buckets = bucket_of(ids, num_buckets)
    pos = jnp.arange(s, dtype=jnp.int32)
    cpos = jnp.arange(a, dtype=jnp.int32)
    lfu = eviction == abi.EvictionId.LFU
    counts0 = jnp.zeros((len(abi.HashCount),), jnp.int32)

    def count(which: abi.HashCount, cond) -> jax.Array:
        return jnp.zeros((len(abi.HashCount),), jnp.int32).at[which].set(cond.astype(jnp.int32))

    def body(i, carry):
        keys, scores, ckeys, cscores, slots, fresh, counts = carry
        key = ids[i]
        pad = _is_empty(key)
        base = buckets[i] * s
        bk = jax.lax.dynamic_slice(keys, (base, 0), (s, 2))
        bs = jax.lax.dynamic_slice(scores, (base, 0), (s, 2))
        empty = _is_empty(bk)
        scanned = (jnp.cumsum(empty) - empty) == 0  # up to and including the first empty
        occupied = scanned & ~empty
        unexp = _unexpired(bs[:, 0], step, ttl)
        live = occupied & unexp
        match = live & (bk[:, 0] == key[0]) & (bk[:, 1] == key[1])
        found = jnp.any(match) & ~pad
        j_found = jnp.argmax(match)
        free = scanned & (empty | (occupied & ~unexp))
        has_free = jnp.any(free)
        j_free = jnp.argmax(free)
        evictable = live & (bs[:, 0] < step)
        if lfu:
            j_victim = _first_min(evictable, bs[:, 1], bs[:, 0])
        else:
            j_victim = _first_min(evictable, bs[:, 0])
        can_evict = jnp.any(evictable) & (eviction != abi.EvictionId.NONE)
        new = ~pad & ~found  # the id needs a row
        if threshold > 1:
            cbase = buckets[i] * a
            ck = jax.lax.dynamic_slice(ckeys, (cbase, 0), (a, 2))
            cs = jax.lax.dynamic_slice(cscores, (cbase, 0), (a, 2))
            c_live = ~_is_empty(ck) & _unexpired(cs[:, 0], step, ttl)
            c_match = c_live & (ck[:, 0] == key[0]) & (ck[:, 1] == key[1])
            c_found = jnp.any(c_match)
            c_j = jnp.where(
                c_found,
                jnp.argmax(c_match),
                jnp.where(
                    jnp.any(~c_live), jnp.argmax(~c_live), _first_min(c_live, cs[:, 0], cs[:, 1])
                ),
            )
            seen = jnp.where(c_found, _sat_inc(cs[c_j, 1]), 1)
            admitted = seen >= threshold
        else:
            seen = jnp.int32(1)
            admitted = jnp.bool_(True)
        target = jnp.where(has_free, j_free, j_victim)
        inserted = new & admitted & (has_free | can_evict)
        refused = new & ~admitted
        dropped = new & admitted & ~has_free & ~can_evict
        expired = inserted & has_free & ~_is_empty(bk[j_free])
        evicted = inserted & ~has_free
        # the main bucket: the found entry's score, or the inserted entry
        hit = (pos == j_found) & found
        put = (pos == target) & inserted
        bs = jnp.where(hit[:, None], jnp.stack([step, _sat_inc(bs[j_found, 1])]), bs)
        bs = jnp.where(put[:, None], jnp.stack([step, seen]), bs)
        bk = jnp.where(put[:, None], key, bk)
        keys = jax.lax.dynamic_update_slice(keys, bk, (base, 0))
        scores = jax.lax.dynamic_update_slice(scores, bs, (base, 0))
        if threshold > 1:
            touch = (cpos == c_j) & new
            clear = touch & inserted
            ck = jnp.where(touch[:, None], key, ck)
            cs = jnp.where(touch[:, None], jnp.stack([step, seen]), cs)
            ck = jnp.where(clear[:, None], jnp.uint32(EMPTY), ck)
            cs = jnp.where(clear[:, None], 0, cs)
            ckeys = jax.lax.dynamic_update_slice(ckeys, ck, (cbase, 0))
            cscores = jax.lax.dynamic_update_slice(cscores, cs, (cbase, 0))
        slot = jnp.where(found, base + j_found, jnp.where(inserted, base + target, -1))
        slots = slots.at[i].set(slot.astype(jnp.int32))
        fresh = fresh.at[i].set(inserted)
        counts = (
            counts
            + count(abi.HashCount.FOUND, found)
            + count(abi.HashCount.INSERTED, inserted)
            + count(abi.HashCount.EVICTED, evicted)
            + count(abi.HashCount.EXPIRED, expired)
            + count(abi.HashCount.REFUSED, refused)
            + count(abi.HashCount.DROPPED, dropped)
        )
        return keys, scores, ckeys, cscores, slots, fresh, counts

    init = (
        keys,
        scores,
        cand_keys,
        cand_scores,
        jnp.full((n,), -1, jnp.int32),
        jnp.zeros((n,), bool),
        counts0,
    )
    return jax.lax.fori_loop(0, n, body, init)
