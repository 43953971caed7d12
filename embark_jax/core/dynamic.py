"""Dynamic embedding tables: the data model (docs/design.md §11).

A dynamic table has no fixed vocabulary: its ids are arbitrary 64-bit values (hashes of
strings, typically), and each shard keeps the rows of the ids it has seen in a bucketed hash
table of fixed capacity (`embark_jax.ops.hash_table`). `DynamicTableConfig` describes one
such table; this module also holds the host-side (numpy) form of the id words and of the
hash, which the kernels and the `jnp` reference compute the same way.

**Ids.** A 64-bit id travels as two uint32 words, `[N, 2]` = (low word, high word), so that
it works without JAX's 64-bit types (`jax_enable_x64`, which the library leaves off).
`key_words` makes them from host ids (int64, uint64, or narrower ints, which are
sign-extended, so an int32 -1 stays -1); `ops.hash_table.as_key_words` does the same on the
device, where int64 ids exist only under `jax_enable_x64`. The id whose 64 bits are all ones
(-1 as an int64, `EMPTY_WORD` in both words) is padding: it is never inserted and finds
nothing, like -1 in the fixed-vocabulary tables.

**Hash.** `hash_words` is a bijective 64-bit mixer built from 32-bit operations only (a
4-round Feistel network whose round function is the `lowbias32` integer hash, `abi::Mix32`),
so that C++, CUDA and `jnp` without 64-bit types compute it bit for bit. Its low word picks
the bucket (`low % num_buckets`); its high word routes an id to a shard (`shard_of`:
`high % shards`), so that the shard and the bucket inside it are independent.

Plain Python and numpy; importing it never loads JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from embark_jax.core.choice import Choice
from embark_jax.core.specs import Combiner, check_tables_and_features

__all__ = [
    "EMPTY_WORD",
    "FEISTEL_KEYS",
    "DynamicConfig",
    "DynamicFeatureConfig",
    "DynamicTableConfig",
    "Eviction",
    "hash_words",
    "join_key_words",
    "key_words",
    "mix32",
    "shard_of",
]

EMPTY_WORD = 0xFFFFFFFF
"""Both words of an empty key slot, and of the padding id (-1 as an int64)."""

FEISTEL_KEYS = (0x9E3779B9, 0x7F4A7C15, 0xF39CC060, 0x5CED1B1B)
"""Round keys of the id hash (`abi::kHashRoundKeys`): one per Feistel round."""

MAX_BUCKET_SIZE = 1024
_TABLE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
_INITIALIZERS = ("uniform", "zeros")


class Eviction(Choice):
    """What a full bucket does when a new id is admitted (`abi.EvictionId`).

    `LRU` replaces the entry seen longest ago, `LFU` the entry seen the fewest times (ties:
    the one seen longest ago), `NONE` never replaces: the newcomer is dropped. Ties left
    after that go to the entry in the lowest position of the bucket. Entries seen in the
    current step are never replaced (their slot may already be in use by this step's
    lookups); if every entry of the bucket was, the newcomer is dropped.
    """

    NONE = "none"
    LRU = "lru"
    LFU = "lfu"


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool | np.bool_) and isinstance(value, int | np.integer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicTableConfig:
    """One dynamic embedding table (one shard's hash table; docs/design.md §11).

    Attributes:
      name: unique table name.
      dim: embedding dimension d.
      dtype: storage dtype of the rows, float32 (default) or bfloat16.
      capacity: rows per shard, a multiple of `bucket_size` (`num_buckets` buckets).
      bucket_size: slots per bucket (1 to 1024, default 32): an id hashes to one bucket and
        may take any of its slots; a larger bucket fills further before it must evict.
      eviction: `lru` (default), `lfu` or `none` (`Eviction`).
      admission_threshold: an id gets a row only on its k-th sighting (default 1: at once).
        Before that, `find_or_insert` returns -1 for it, so a lookup reads zeros and its
        gradient is dropped; the sightings are counted per bucket in
        `admission_candidates` candidate slots (least recently seen forgotten first).
      admission_candidates: candidate slots per bucket when `admission_threshold` > 1
        (default: `bucket_size`); must be 0 (the default) when it is 1.
      ttl_steps: optional time to live: an entry not seen for more than this many steps
        expires (it finds nothing and its slot is free for a newcomer; the id, seen again,
        is new). None (default): entries never expire.
      initializer: the row of a newly inserted id: `uniform` (default; uniform in
        `[-init_scale, init_scale)` from a hash of the id, the column and `seed`, so the
        row depends on nothing but the id) or `zeros`.
      init_scale: half-width of the uniform initializer; default `1 / sqrt(dim)`.
      seed: uint32 salt of the uniform initializer (default 0).
    """

    name: str
    dim: int
    capacity: int
    dtype: Any = np.float32
    bucket_size: int = 32
    eviction: Eviction | str = Eviction.LRU
    admission_threshold: int = 1
    admission_candidates: int | None = None
    ttl_steps: int | None = None
    initializer: str = "uniform"
    init_scale: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"dynamic table name must be a non-empty string, got {self.name!r}")
        where = f"dynamic table {self.name!r}"
        for field, low in (("dim", 1), ("bucket_size", 1), ("capacity", 1)):
            value = getattr(self, field)
            if not _is_int(value):
                raise ValueError(f"{where}: {field} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"{where}: {field} must be >= {low}, got {value}")
            object.__setattr__(self, field, int(value))
        if self.bucket_size > MAX_BUCKET_SIZE:
            raise ValueError(
                f"{where}: bucket_size must be <= {MAX_BUCKET_SIZE}, got {self.bucket_size}"
            )
        if self.capacity % self.bucket_size:
            raise ValueError(
                f"{where}: capacity must be a multiple of bucket_size {self.bucket_size}, "
                f"got {self.capacity}"
            )
        if self.capacity > 2**31 - 1:
            raise ValueError(
                f"{where}: capacity must be < 2**31 (int32 slots), got {self.capacity}"
            )
        try:
            dtype = np.dtype(
                ml_dtypes.bfloat16
                if isinstance(self.dtype, str) and self.dtype.lower() in ("bfloat16", "bf16")
                else self.dtype
            )
        except TypeError:
            dtype = None
        if dtype not in _TABLE_DTYPES:
            raise ValueError(f"{where}: dtype must be float32 or bfloat16, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        try:
            object.__setattr__(self, "eviction", Eviction.parse(self.eviction))
        except ValueError as e:
            raise ValueError(f"{where}: eviction: {e}") from None
        t = self.admission_threshold
        if not _is_int(t) or t < 1:
            raise ValueError(f"{where}: admission_threshold must be an int >= 1, got {t!r}")
        object.__setattr__(self, "admission_threshold", int(t))
        a = self.admission_candidates
        if a is None:
            a = self.bucket_size if t > 1 else 0
        elif not _is_int(a) or a < 0:
            raise ValueError(f"{where}: admission_candidates must be an int >= 0, got {a!r}")
        elif t == 1 and a != 0:
            raise ValueError(
                f"{where}: admission_candidates must be 0 when admission_threshold is 1, got {a}"
            )
        elif t > 1 and a == 0:
            raise ValueError(
                f"{where}: admission_candidates must be >= 1 when admission_threshold is {t}, got 0"
            )
        object.__setattr__(self, "admission_candidates", int(a))
        ttl = self.ttl_steps
        if ttl is not None and (not _is_int(ttl) or not 1 <= ttl < 2**31):
            raise ValueError(
                f"{where}: ttl_steps must be None or an int in [1, 2**31), got {ttl!r}"
            )
        if ttl is not None:
            object.__setattr__(self, "ttl_steps", int(ttl))
        if self.initializer not in _INITIALIZERS:
            raise ValueError(
                f"{where}: initializer must be one of {', '.join(_INITIALIZERS)}, "
                f"got {self.initializer!r}"
            )
        s = self.init_scale
        if s is not None:
            if isinstance(s, bool | np.bool_) or not isinstance(s, int | float | np.number):
                raise ValueError(f"{where}: init_scale must be a number, got {s!r}")
            if not (math.isfinite(float(s)) and float(s) >= 0):
                raise ValueError(f"{where}: init_scale must be finite and >= 0, got {s!r}")
            object.__setattr__(self, "init_scale", float(s))
        if not _is_int(self.seed) or not 0 <= self.seed <= EMPTY_WORD:
            raise ValueError(f"{where}: seed must be an int in [0, 2**32), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))

    @property
    def num_buckets(self) -> int:
        return self.capacity // self.bucket_size

    @property
    def scale(self) -> float:
        """The uniform initializer's half-width (`init_scale`, default `1 / sqrt(dim)`)."""
        return self.init_scale if self.init_scale is not None else 1.0 / math.sqrt(self.dim)

    @property
    def ttl(self) -> int:
        """`ttl_steps` as the kernels take it: 0 for none."""
        return self.ttl_steps or 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicFeatureConfig:
    """A feature looked up in a dynamic table: up to `max_hotness` ids a sample, pooled by
    `combiner` (`sum` default, `mean` or `sqrtn`; a mean or sqrtn divides by the sample's
    non-padding ids, refused and dropped ones included, which read zeros)."""

    name: str
    table: str
    max_hotness: int = 1
    combiner: Combiner | str = Combiner.SUM

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"dynamic feature name must be a non-empty string, got {self.name!r}")
        where = f"dynamic feature {self.name!r}"
        if not _is_int(self.max_hotness) or self.max_hotness < 1:
            raise ValueError(f"{where}: max_hotness must be an int >= 1, got {self.max_hotness!r}")
        object.__setattr__(self, "max_hotness", int(self.max_hotness))
        try:
            combiner = Combiner.parse(self.combiner)
        except ValueError as e:
            raise ValueError(f"{where}: combiner: {e}") from None
        if combiner is Combiner.NONE:
            raise ValueError(f"{where}: combiner must be sum, mean or sqrtn, got 'none'")
        object.__setattr__(self, "combiner", combiner)


@dataclasses.dataclass(frozen=True)
class DynamicConfig:
    """The dynamic tables of a model and the features that look them up: names unique
    (tables and features), every feature's table among `tables`, every table used.

    `replicated`: names of tables held whole on every device (data-parallel, for small
    tables: no all-to-all; every device inserts every device's ids in the same order, so
    the replicas stay identical); the others are sharded by `shard_of`. A replicated
    table's `capacity` is the whole table's, a sharded one's each shard's.
    """

    tables: tuple[DynamicTableConfig, ...] = ()
    features: tuple[DynamicFeatureConfig, ...] = ()
    replicated: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "features", tuple(self.features))
        for kind, items, cls in (
            ("table", self.tables, DynamicTableConfig),
            ("feature", self.features, DynamicFeatureConfig),
        ):
            for x in items:
                if not isinstance(x, cls):
                    raise ValueError(f"dynamic {kind}s must be {cls.__name__}s, got {x!r}")
        check_tables_and_features(self.tables, self.features, "dynamic ")
        replicated = self.replicated
        if isinstance(replicated, str) or not all(isinstance(n, str) for n in replicated):
            raise ValueError(f"dynamic replicated must be table names, got {replicated!r}")
        object.__setattr__(self, "replicated", tuple(dict.fromkeys(replicated)))
        unknown = sorted(set(self.replicated) - {t.name for t in self.tables})
        if unknown:
            raise ValueError(f"dynamic replicated tables {unknown} are not dynamic tables")

    def table(self, name: str) -> DynamicTableConfig:
        return next(t for t in self.tables if t.name == name)

    def features_of(self, table: str) -> tuple[DynamicFeatureConfig, ...]:
        return tuple(f for f in self.features if f.table == table)

    def is_replicated(self, table: str) -> bool:
        return table in self.replicated


def key_words(ids: Any) -> np.ndarray:
    """Host ids as the `[N, 2]` uint32 (low, high) words the kernels take.

    `ids`: `[N]` integers (int64 or uint64 as their 64 bits; narrower signed ints
    sign-extended, so -1 stays padding; narrower unsigned ints zero-extended), or already
    `[N, 2]` uint32 words. Anything else is a one-line `ValueError`.
    """
    a = np.asarray(ids)
    if a.dtype == np.uint32 and a.ndim == 2 and a.shape[1] == 2:
        return np.ascontiguousarray(a)
    if a.size == 0 and a.ndim == 1:
        return np.zeros((0, 2), np.uint32)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(
            f"dynamic ids must be [N] integers or [N, 2] uint32 words, got {a.dtype} "
            f"of shape {a.shape}"
        )
    u = a.astype(np.int64).view(np.uint64) if a.dtype.kind == "i" else a.astype(np.uint64)
    return np.stack([(u & 0xFFFFFFFF).astype(np.uint32), (u >> 32).astype(np.uint32)], axis=1)


def join_key_words(words: np.ndarray) -> np.ndarray:
    """`[N, 2]` uint32 words back to `[N]` int64 ids (the inverse of `key_words`)."""
    w = np.asarray(words, np.uint32).astype(np.uint64)
    return ((w[:, 1] << np.uint64(32)) | w[:, 0]).view(np.int64)


def mix32(x: np.ndarray) -> np.ndarray:
    """`lowbias32` on uint32 arrays (`abi::Mix32`)."""
    x = np.asarray(x, np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))


def hash_words(words: np.ndarray) -> np.ndarray:
    """`[N, 2]` uint32 hash words of `[N, 2]` key words (`abi::HashKey`): a 4-round Feistel
    network, `(l, r) <- (r, l ^ mix32(r ^ k_i))`, starting from (low, high). The result's
    word 0 picks the bucket, word 1 is kept for shard routing."""
    w = np.asarray(words, np.uint32)
    left, right = w[:, 0], w[:, 1]
    for k in FEISTEL_KEYS:
        left, right = right, left ^ mix32(right ^ np.uint32(k))
    return np.stack([left, right], axis=1)


def shard_of(words: np.ndarray, num_shards: int) -> np.ndarray:
    """`[N]` int32 shard owning each id of `words` `[N, 2]` uint32: the high word of its hash
    modulo `num_shards` (`ops.hash_reference.shard_of` on the device). Padding ids get a
    shard too; callers skip them."""
    return (hash_words(words)[:, 1] % np.uint32(num_shards)).astype(np.int32)
