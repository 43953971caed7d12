"""Table and feature specifications: frozen, keyword-only, validated at construction.

A `TableConfig` describes one embedding table; a `FeatureConfig` one input slot that looks up a
table by name (several features may share a table). `EmbeddingConfig` holds both and checks
the cross references once, so everything downstream can trust it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from embark_jax.core.choice import Choice

__all__ = [
    "Combiner",
    "EmbeddingConfig",
    "FeatureConfig",
    "TableConfig",
    "as_dtype",
    "check_tables_and_features",
    "table_dirname",
]

# `init(key, shape, dtype) -> array`: a JAX PRNG key in, a JAX array out.
Initializer = Callable[[Any, tuple[int, ...], Any], Any]


# The longest `table_dirname` a table may have: checkpoints store each table in a directory
# of that name, and Orbax writes it first under the name plus ".orbax-checkpoint-tmp-" and a
# timestamp, all within the file systems' 255 bytes per name.
MAX_TABLE_DIRNAME = 200

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def table_dirname(name: str) -> str:
    """A table name as one safe path component (letters, digits, `_`, `-` kept; every other
    byte of its UTF-8 form written `%XX`): `../x` -> `%2E%2E%2Fx`."""
    out = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in name)
    if not out:
        raise ValueError("a table name must not be empty")
    return out


def as_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a dtype, a scalar type or a name (`"bfloat16"` included), without
    importing JAX (bfloat16 comes from `ml_dtypes`, the package JAX itself uses)."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


class Combiner(Choice):
    """How the vectors of one sample's ids are combined.

    `SUM`, `MEAN` and `SQRTN` pool one vector per sample (MEAN divides by the sum of the
    weights of the non-padding ids, SQRTN by the square root of the sum of their squared
    weights; unweighted, these are the count and its square root). `NONE` is a sequence
    feature: one vector per id, no pooling (HugeCTR's "concat").
    """

    SUM = "sum"
    MEAN = "mean"
    SQRTN = "sqrtn"
    NONE = "none"

    @property
    def pooled(self) -> bool:
        return self is not Combiner.NONE


def default_initializer(dim: int) -> Initializer:
    """Uniform(-1/sqrt(dim), 1/sqrt(dim)), the DLRM reference initialisation."""
    scale = 1.0 / float(np.sqrt(dim))

    def init(key, shape, dtype=np.float32):
        import jax  # the data model itself never needs JAX

        return jax.random.uniform(key, shape, np.float32, -scale, scale).astype(dtype)

    return init


_TABLE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One embedding table.

    Attributes:
      name: unique table name.
      vocab_size: number of rows V; valid ids are [0, V).
      dim: embedding dimension d (columns).
      dtype: storage dtype, float32 (default) or bfloat16. A bfloat16 table keeps 8 bits of
        mantissa: the sparse optimizers compute in float32 and store each updated element
        back as bfloat16, rounded as `stochastic_rounding` says.
      initializer: `init(key, shape, dtype)`; default uniform(+-1/sqrt(dim)). A sharded
        table calls it once per shard, with that shard's `(rows, width)` shape.
      stochastic_rounding: bfloat16 tables only (float32 tables are stored exactly and
        ignore it). True (default, as FBGEMM's `stochastic_rounding=True`): each updated
        element is rounded to one of the two nearest bfloat16 values, the upper one with
        probability equal to its distance from the lower in units of their gap, so the
        stored value is unbiased and updates below the bfloat16 resolution are kept on
        average (20 SGD steps of 1e-3 move 1.0 by about 0.02 in expectation). The random
        bits are a hash of a per-step seed (from the training state's PRNG key and step
        counter, or the collection's own counter) and the element's row and column:
        training is reproducible given the seed, and replicas of a data-parallel table get
        identical updates. False: round to nearest even, deterministic, but an update
        smaller than about 2^-9 of a weight is lost (20 SGD steps of 1e-3 leave 1.0
        unchanged).
    """

    name: str
    vocab_size: int
    dim: int
    dtype: Any = np.float32
    initializer: Initializer | None = None
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty string, got {self.name!r}")
        path = len(table_dirname(self.name))
        if path > MAX_TABLE_DIRNAME:
            short = self.name if len(self.name) <= 40 else f"{self.name[:40]}..."
            raise ValueError(
                f"table name {short!r} is too long: {len(self.name)} characters, {path} as "
                f"a checkpoint directory name (a character other than a letter, digit, _ or - "
                f"takes 3 per UTF-8 byte); at most {MAX_TABLE_DIRNAME} are allowed"
            )
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int | np.integer):
            raise ValueError(
                f"table {self.name!r}: vocab_size must be an int, got {self.vocab_size!r}"
            )
        if self.vocab_size < 1:
            raise ValueError(f"table {self.name!r}: vocab_size must be >= 1, got {self.vocab_size}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int | np.integer):
            raise ValueError(f"table {self.name!r}: dim must be an int, got {self.dim!r}")
        if self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim must be >= 1, got {self.dim}")
        try:
            dtype = as_dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype not in _TABLE_DTYPES:
            raise ValueError(
                f"table {self.name!r}: dtype must be float32 or bfloat16, got {self.dtype!r}"
            )
        if not isinstance(self.stochastic_rounding, bool | np.bool_):
            raise ValueError(
                f"table {self.name!r}: stochastic_rounding must be True or False, "
                f"got {self.stochastic_rounding!r}"
            )
        object.__setattr__(self, "stochastic_rounding", bool(self.stochastic_rounding))

    @property
    def rounds_stochastically(self) -> bool:
        """Whether the sparse optimizers round this table's updates stochastically: a
        bfloat16 table with `stochastic_rounding` (float32 tables are stored exactly)."""
        return self.stochastic_rounding and as_dtype(self.dtype) == np.dtype(ml_dtypes.bfloat16)

    def init(self, key: Any) -> Any:
        """Returns a freshly initialised [vocab_size, dim] table (a JAX array)."""
        init = self.initializer or default_initializer(self.dim)
        return init(key, (self.vocab_size, self.dim), as_dtype(self.dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """One sparse input slot.

    Attributes:
      name: unique feature name.
      table: name of the table it looks up.
      max_hotness: most ids one sample may carry (the static capacity of its bag).
      combiner: `Combiner` or its string value; default `sum`.
      weighted: whether inputs carry a weight per id (a bool; `"no"` or 1 is an error).
    """

    name: str
    table: str
    max_hotness: int = 1
    combiner: Combiner | str = Combiner.SUM
    weighted: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"feature name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.table, str) or not self.table:
            raise ValueError(
                f"feature {self.name!r}: table must be a table name, got {self.table!r}"
            )
        if isinstance(self.max_hotness, bool) or not isinstance(self.max_hotness, int | np.integer):
            raise ValueError(
                f"feature {self.name!r}: max_hotness must be an int, got {self.max_hotness!r}"
            )
        if self.max_hotness < 1:
            raise ValueError(
                f"feature {self.name!r}: max_hotness must be >= 1, got {self.max_hotness}"
            )
        try:
            combiner = Combiner.parse(self.combiner)
        except ValueError as e:
            raise ValueError(f"feature {self.name!r}: {e}") from None
        object.__setattr__(self, "combiner", combiner)
        if not isinstance(self.weighted, bool | np.bool_):
            raise ValueError(
                f"feature {self.name!r}: weighted must be True or False, got {self.weighted!r}"
            )
        object.__setattr__(self, "weighted", bool(self.weighted))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingConfig:
    """Tables and the features that look them up, cross-checked once.

    Raises `ValueError` on duplicate table or feature names, a feature naming an unknown
    table, or a table no feature uses.
    """

    tables: tuple[TableConfig, ...]
    features: tuple[FeatureConfig, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "features", tuple(self.features))
        if not self.tables:
            raise ValueError("EmbeddingConfig needs at least one table")
        check_tables_and_features(self.tables, self.features)

    @property
    def table_by_name(self) -> Mapping[str, TableConfig]:
        return {t.name: t for t in self.tables}

    @property
    def feature_by_name(self) -> Mapping[str, FeatureConfig]:
        return {f.name: f for f in self.features}

    def table_of(self, feature: str | FeatureConfig) -> TableConfig:
        name = feature.name if isinstance(feature, FeatureConfig) else feature
        try:
            return self.table_by_name[self.feature_by_name[name].table]
        except KeyError:
            raise ValueError(f"unknown feature {name!r}") from None

    @classmethod
    def create(
        cls, tables: Sequence[TableConfig], features: Sequence[FeatureConfig]
    ) -> EmbeddingConfig:
        return cls(tables=tuple(tables), features=tuple(features))


def check_tables_and_features(tables: Sequence, features: Sequence, kind: str = "") -> None:
    """Table and feature names unique, every feature's table among `tables`, every table
    looked up (`kind`: a prefix of the messages' nouns, e.g. "dynamic ")."""
    _check_unique(f"{kind}table", [t.name for t in tables])
    _check_unique(f"{kind}feature", [f.name for f in features])
    names = {t.name for t in tables}
    for f in features:
        if f.table not in names:
            raise ValueError(
                f"{kind}feature {f.name!r} looks up unknown {kind}table {f.table!r}; "
                f"known {kind}tables: {sorted(names)}"
            )
    unused = sorted(names - {f.table for f in features})
    if unused:
        raise ValueError(f"{kind}tables not looked up by any feature: {unused}")


def _check_unique(kind: str, names: Sequence[str]) -> None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ValueError(f"duplicate {kind} name {n!r}")
        seen.add(n)
