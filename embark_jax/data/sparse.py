"""`SparseFeatures`: the sparse input of one batch in a fixed-capacity, jit-friendly layout.

Per feature:
  ids      [B, H]  int32 (int64 under `jax_enable_x64`); valid ids packed to the left of each
                   row, empty slots are -1. H is the feature's `max_hotness` when a config is
                   given, else the widest row.
  lengths  [B]     int32, number of valid ids of each sample.
  weights  [B, H]  float32, only for weighted features; 0 in empty slots.

All constructors validate on the host, before anything reaches a device: non-integer ids,
negative ids, ids >= vocab_size, bags longer than `max_hotness`, lengths that disagree with
the ids, NaN/inf weights, a ragged nested list, and a weighted `mean` / `sqrtn` bag whose
denominator is below `MIN_POOL_DENOMINATOR` (float32 would pool it to zeros) each raise a
`ValueError` naming the feature and the offending value and position.

Ids of 2**31 and above cannot be held by int32: without `jax_enable_x64` they raise a
`ValueError` (never a silent wrap); with it, int64 ids stay int64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax.core.names import name_mismatch
from embark_jax.core.specs import Combiner, EmbeddingConfig

__all__ = ["SparseFeatures"]

PAD = -1
_INT32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class SparseFeatures:
    """Sparse features of one batch; a JAX pytree (see the module docstring for the layout).

    Build it with `from_dense`, `from_ragged` or `from_lengths`; the plain constructor does
    no validation (JAX uses it to rebuild the pytree). `EmbeddingCollection` checks such a
    hand-built batch's layout (`check_layout`) and the types of its host ids before it
    reaches a device, and drops ids outside their table there (`sharding.bounds`). When JAX
    flattens the batch (e.g. at a caller's own `jit`), host ids and lengths of a type JAX
    could wrap are checked by value first (`_refuse_wrapping`).
    """

    ids: Mapping[str, jax.Array | np.ndarray]
    lengths: Mapping[str, jax.Array | np.ndarray]
    weights: Mapping[str, jax.Array | np.ndarray] = dataclasses.field(default_factory=dict)

    # --- constructors --------------------------------------------------------------------

    @classmethod
    def abstract(cls, config: EmbeddingConfig, batch_size: int, id_dtype=np.int32):
        """The shapes of a batch of `batch_size` samples for `config` (every feature
        `[B, max_hotness]`), as `jax.ShapeDtypeStruct`s: for `jax.eval_shape` and what sizes
        itself by a batch before one exists (`sharding.init_staging`)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
            raise ValueError(
                f"SparseFeatures.abstract: batch_size must be an int, got {batch_size!r}"
            )
        if batch_size < 1:
            raise ValueError(f"SparseFeatures.abstract: batch_size must be >= 1, got {batch_size}")
        ids = {
            f.name: jax.ShapeDtypeStruct((batch_size, f.max_hotness), id_dtype)
            for f in config.features
        }
        lengths = {f.name: jax.ShapeDtypeStruct((batch_size,), np.int32) for f in config.features}
        weights = {
            f.name: jax.ShapeDtypeStruct((batch_size, f.max_hotness), np.float32)
            for f in config.features
            if f.weighted
        }
        return cls(ids, lengths, weights)

    @classmethod
    def from_dense(
        cls,
        ids: Mapping[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        pad: int = PAD,
        *,
        config: EmbeddingConfig | None = None,
    ) -> SparseFeatures:
        """From dense `[B, H]` id arrays where `pad` marks empty slots (anywhere in a row).

        Valid ids are packed to the left, keeping their order. With `config`, every feature
        of the config must be present, ids are checked against the table's vocabulary and
        the output width is the feature's `max_hotness`.
        """
        weights = dict(weights or {})
        _check_names(ids, weights, config)
        parts = _Parts()
        batch = None
        for name, raw in ids.items():
            arr = _as_int_array(name, raw)
            if arr.ndim != 2:
                raise ValueError(
                    f"feature {name!r}: dense ids must be [B, H], got shape {arr.shape}"
                )
            batch = _check_batch(name, arr.shape[0], batch)
            valid = arr != pad
            w = None
            if name in weights:
                w = _as_weight_array(name, weights[name], arr.shape)
                _check_finite(name, w, valid)
            lengths = valid.sum(axis=1)
            order = np.argsort(~valid, axis=1, kind="stable")
            packed = np.take_along_axis(arr, order, axis=1)
            packed_valid = np.arange(arr.shape[1])[None, :] < lengths[:, None]
            packed = np.where(packed_valid, packed, PAD)
            if w is not None:
                w = np.where(packed_valid, np.take_along_axis(w, order, axis=1), 0.0)
            parts.add(name, packed, lengths, w, config)
        return parts.build(cls, config)

    @classmethod
    def from_lengths(
        cls,
        values: Mapping[str, np.ndarray],
        lengths: Mapping[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        *,
        config: EmbeddingConfig | None = None,
    ) -> SparseFeatures:
        """From the jagged (values, lengths) form: `values[name]` holds the ids of all
        samples back to back, `lengths[name][b]` how many belong to sample b."""
        weights = dict(weights or {})
        _check_names(values, weights, config)
        if set(lengths) != set(values):
            raise ValueError(
                f"lengths given for features {sorted(lengths)} but values for {sorted(values)}"
            )
        parts = _Parts()
        batch = None
        for name, raw in values.items():
            vals = _as_int_array(name, raw)
            if vals.ndim != 1:
                raise ValueError(f"feature {name!r}: values must be 1-D, got shape {vals.shape}")
            lens = np.asarray(lengths[name])
            if lens.ndim != 1 or not np.issubdtype(lens.dtype, np.integer):
                raise ValueError(
                    f"feature {name!r}: lengths must be a 1-D integer array, got "
                    f"{lens.dtype} of shape {lens.shape}"
                )
            batch = _check_batch(name, lens.shape[0], batch)
            if lens.dtype.kind == "u":  # as int64, before any sum (a uint64 sum wraps)
                if lens.size and lens.max() > np.iinfo(np.int64).max:
                    raise ValueError(f"feature {name!r}: length {int(lens.max())} is too large")
                lens = lens.astype(np.int64)
            if lens.size and lens.min() < 0:
                b = int(np.argmin(lens))
                raise ValueError(f"feature {name!r}: negative length {int(lens[b])} at sample {b}")
            if int(lens.sum()) != vals.shape[0]:
                raise ValueError(
                    f"feature {name!r}: lengths sum to {int(lens.sum())} but {vals.shape[0]} "
                    "values were given"
                )
            w = None
            if name in weights:
                w = _as_weight_array(name, weights[name], vals.shape)
                _check_finite(name, w[None, :], np.ones((1, vals.shape[0]), bool))
            width = int(lens.max()) if lens.size else 0
            if config is not None:
                width = max(width, config.feature_by_name[name].max_hotness)
            width = max(width, 1)
            row = np.repeat(np.arange(lens.shape[0]), lens)
            col = np.arange(vals.shape[0]) - np.repeat(np.cumsum(lens) - lens, lens)
            dense = np.full((lens.shape[0], width), PAD, dtype=vals.dtype)
            dense[row, col] = vals
            dw = None
            if w is not None:
                dw = np.zeros((lens.shape[0], width), np.float32)
                dw[row, col] = w
            if (vals < 0).any():
                i = int(np.argmax(vals < 0))
                raise ValueError(
                    f"feature {name!r}: negative id {int(vals[i])} at sample {int(row[i])}, "
                    f"position {int(col[i])}"
                )
            parts.add(name, dense, lens, dw, config)
        return parts.build(cls, config)

    @classmethod
    def from_ragged(
        cls,
        ids: Mapping[str, Sequence[Sequence[int]]],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
        *,
        config: EmbeddingConfig | None = None,
    ) -> SparseFeatures:
        """From ragged Python or numpy lists: `ids[name][b]` is the id list of sample b."""
        values, lengths, wvals = {}, {}, {}
        for name, rows in ids.items():
            rows = [np.asarray(r).reshape(-1) for r in rows]
            # each row checked alone (mixing bool or uint64 rows with int ones gave int or
            # float); an empty row has no type to check ([] is float64 to numpy)
            rows = [_as_int_array(name, r) if r.size else r.astype(np.int32) for r in rows]
            lengths[name] = np.array([r.shape[0] for r in rows], dtype=np.int64)
            dtypes = [r.dtype for r in rows if r.size]
            dtype = np.result_type(*dtypes) if dtypes else np.int32
            values[name] = (
                np.concatenate([r.astype(dtype) for r in rows]) if rows else np.zeros(0, dtype)
            )
            if weights and name in weights:
                wrows = [np.asarray(r, dtype=np.float64).reshape(-1) for r in weights[name]]
                if [r.shape[0] for r in wrows] != list(lengths[name]):
                    raise ValueError(
                        f"feature {name!r}: weights lengths {[r.shape[0] for r in wrows]} do "
                        f"not match ids lengths {lengths[name].tolist()}"
                    )
                wvals[name] = np.concatenate(wrows) if wrows else np.zeros(0)
        if weights:
            unknown = sorted(set(weights) - set(ids))
            if unknown:
                raise ValueError(f"weights given for features without ids: {unknown}")
        return cls.from_lengths(values, lengths, wvals, config=config)

    # --- views ---------------------------------------------------------------------------

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(self.ids)

    @property
    def batch_size(self) -> int:
        first = next(iter(self.lengths.values()))
        return int(np.shape(first)[0])

    def hotness(self, name: str) -> int:
        return int(np.shape(self.ids[name])[1])

    def flat(self, name: str) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """`(ids [B*H], segment_ids [B*H], weights [B*H] or None)` for the ops in
        `embark_jax.ops`: the segment of slot (b, h) is b; empty slots keep id -1."""
        ids = jnp.asarray(self.ids[name])
        b, h = ids.shape
        seg = jnp.repeat(jnp.arange(b, dtype=jnp.int32), h)
        w = self.weights.get(name)
        return ids.reshape(-1), seg, None if w is None else jnp.asarray(w).reshape(-1)

    def to_ragged(self) -> tuple[dict[str, list[np.ndarray]], dict[str, list[np.ndarray]]]:
        """Inverse of `from_ragged`: per feature, a list of per-sample id (and weight) arrays."""
        out_ids, out_w = {}, {}
        for name, ids in self.ids.items():
            ids = np.asarray(ids)
            lens = np.asarray(self.lengths[name])
            out_ids[name] = [ids[b, : lens[b]] for b in range(ids.shape[0])]
            if name in self.weights:
                w = np.asarray(self.weights[name])
                out_w[name] = [w[b, : lens[b]] for b in range(ids.shape[0])]
        return out_ids, out_w

    def check_layout(self, config: EmbeddingConfig | None = None) -> None:
        """The layout's shapes and types, without reading a value (arrays or tracers; for a
        hand-built batch): per feature `[B, H]` ids, `[B]` integer lengths and numeric
        weights shaped like the ids, one B for every feature; with `config`, every configured
        feature and no other, and weights only for weighted ones. A one-line `ValueError`
        naming the feature otherwise. H is not checked against `max_hotness`: the outputs
        follow the ids' width. `validate` checks the values too."""
        _check_names(self.ids, self.weights, config)
        unknown = sorted(set(self.lengths) - set(self.ids))
        if unknown:
            raise ValueError(f"lengths given for features without ids: {unknown}")
        batch = None
        for name, ids in self.ids.items():
            shape = tuple(np.shape(ids))
            if len(shape) != 2:
                raise ValueError(f"feature {name!r}: ids must be [B, H], got shape {shape}")
            batch = _check_batch(name, shape[0], batch)
            if name not in self.lengths:
                raise ValueError(f"feature {name!r}: lengths missing (ids given, no lengths)")
            lengths = self.lengths[name]
            dt = _dtype_of(lengths)
            if dt == np.bool_ or not np.issubdtype(dt, np.integer):
                raise ValueError(f"feature {name!r}: lengths must be integers, got dtype {dt}")
            if tuple(np.shape(lengths)) != shape[:1]:
                raise ValueError(
                    f"feature {name!r}: lengths shape {tuple(np.shape(lengths))} != "
                    f"({shape[0]},), one per sample"
                )
            if name in self.weights:
                w = self.weights[name]
                _check_weight_dtype(name, _dtype_of(w))
                if tuple(np.shape(w)) != shape:
                    raise ValueError(
                        f"feature {name!r}: weights shape {tuple(np.shape(w))} != the ids' {shape}"
                    )

    def validate(self, config: EmbeddingConfig) -> None:
        """Re-runs the host-side checks against `config` (e.g. for a hand-built batch): the
        ids as in `from_dense`, and every feature's lengths present, a 1-D integer array of
        one entry per sample, equal to the number of valid ids of that sample. A batch a
        constructor built and checked against this same `config` is not checked twice."""
        if getattr(self, "_checked_config", None) is config:
            return
        ids = {n: np.asarray(v) for n, v in self.ids.items()}
        rebuilt = SparseFeatures.from_dense(
            ids, {n: np.asarray(w) for n, w in self.weights.items()}, config=config
        )
        for name in ids:
            _check_lengths(name, self.lengths, rebuilt.lengths[name])


# --- the pytree: host ids that JAX would wrap are refused when it flattens the batch -------

_FIELDS = ("ids", "lengths", "weights")
_KEYS = tuple(jax.tree_util.GetAttrKey(f) for f in _FIELDS)


def _wide_host_ints(x) -> np.ndarray | None:
    """`x` as a numpy array when it is a host integer array (or a list of integers) whose
    type may hold values that JAX's conversion would wrap: wider than the ids JAX holds
    (int32, or int64 with `jax_enable_x64`), or unsigned of that width or more. None for
    everything else (JAX arrays and tracers, narrow types, floats), which costs nothing."""
    if isinstance(x, (list, tuple)):
        if not x or any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x)):
            return None
        try:
            x = np.asarray(x)
        except (ValueError, OverflowError):  # ragged, or beyond int64: JAX refuses those
            return None
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "iu" or not x.size:
        return None
    target = 8 if jax.config.jax_enable_x64 else 4
    size = x.dtype.itemsize
    if (x.dtype.kind == "i" and size <= target) or (x.dtype.kind == "u" and size < target):
        return None
    return x


def _refuse_wrapping(sf: SparseFeatures) -> None:
    """A one-line `ValueError` naming the feature, the value and its position when a host
    id or length of `sf` lies outside the integers JAX holds. Runs whenever the batch is
    flattened: a caller's own `jit` converts host arrays after flattening its arguments,
    and with 64-bit types off it wraps an int64 id of 2**32 + 5 to 5, a valid row that no
    later check could tell from a real one."""
    bits = 64 if jax.config.jax_enable_x64 else 32
    info = np.iinfo(np.int64 if bits == 64 else np.int32)
    for what, field in (("id", sf.ids), ("length", sf.lengths)):
        if not isinstance(field, Mapping):
            continue
        for name, value in field.items():
            x = _wide_host_ints(value)
            if x is None:
                continue
            lo, hi = x.min(), x.max()
            if lo >= info.min and hi <= info.max:
                continue
            bad = hi if hi > info.max else lo
            pos = tuple(int(i) for i in np.argwhere(x == bad)[0])
            hint = (
                "and JAX's 64-bit types are off (jax_enable_x64), so it would wrap to another "
                "value; enable them or pass int32 values"
                if bits == 32
                else ", the widest integers JAX holds"
            )
            raise ValueError(
                f"feature {name!r}: {what} {int(bad)} at position {pos} is outside "
                f"int{bits} {hint}".replace(" ,", ",")
            )


def _flatten(sf: SparseFeatures):
    _refuse_wrapping(sf)
    return (sf.ids, sf.lengths, sf.weights), None


def _flatten_with_keys(sf: SparseFeatures):
    _refuse_wrapping(sf)
    return tuple(zip(_KEYS, (sf.ids, sf.lengths, sf.weights), strict=True)), None


def _unflatten(_aux, children) -> SparseFeatures:
    return SparseFeatures(*children)


jax.tree_util.register_pytree_with_keys(
    SparseFeatures, _flatten_with_keys, _unflatten, flatten_func=_flatten
)


# --- host-side validation helpers ----------------------------------------------------------


def _checked(batch: SparseFeatures, config: EmbeddingConfig | None) -> SparseFeatures:
    """`batch`, marked as checked against `config` by its constructor (`validate` then
    skips it). A pytree rebuilt from it (any transformation) carries no mark."""
    if config is not None:
        object.__setattr__(batch, "_checked_config", config)
    return batch


def _check_names(ids: Mapping, weights: Mapping, config: EmbeddingConfig | None) -> None:
    if not ids:
        raise ValueError("no features given")
    unknown_w = sorted(set(weights) - set(ids))
    if unknown_w:
        raise ValueError(f"weights given for features without ids: {unknown_w}")
    if config is None:
        return
    unknown, missing = name_mismatch(ids, config.feature_by_name)
    if unknown:
        known = sorted(config.feature_by_name)
        raise ValueError(f"unknown features {unknown}; configured features: {known}")
    if missing:
        raise ValueError(f"missing ids for configured features {missing}")
    for name in weights:
        if not config.feature_by_name[name].weighted:
            raise ValueError(
                f"feature {name!r}: weights given but the feature is not configured weighted=True"
            )


def _check_lengths(name: str, lengths: Mapping, want: np.ndarray) -> None:
    """The given `lengths[name]` against the `want` counted from the ids."""
    if name not in lengths:
        raise ValueError(f"feature {name!r}: lengths missing (ids given, no lengths)")
    got = np.asarray(lengths[name])
    if got.dtype == np.bool_ or not np.issubdtype(got.dtype, np.integer):
        raise ValueError(f"feature {name!r}: lengths must be integers, got dtype {got.dtype}")
    if got.shape != want.shape:
        raise ValueError(
            f"feature {name!r}: lengths shape {got.shape} != ({want.shape[0]},), one per sample"
        )
    if not np.array_equal(got, want):
        bad = int(np.argmax(got != want))
        raise ValueError(
            f"feature {name!r}: length {int(got[bad])} at sample {bad} disagrees with its "
            f"{int(want[bad])} valid ids"
        )


def _check_batch(name: str, b: int, batch: int | None) -> int:
    if batch is not None and b != batch:
        raise ValueError(f"feature {name!r}: batch size {b} differs from other features' {batch}")
    return b


def _rectangular(name: str, what: str, raw) -> np.ndarray:
    """`raw` as a numpy array; a ragged nested list is a one-line `ValueError` naming the
    feature and the first row whose length differs from the first row's."""
    try:
        return np.asarray(raw)
    except ValueError:  # numpy: "setting an array element with a sequence"
        rows = list(raw) if isinstance(raw, (list, tuple)) else []
        sizes = [len(r) if hasattr(r, "__len__") else None for r in rows]
        bad = next((i for i, n in enumerate(sizes) if n != sizes[0]), None)

        def count(i: int) -> str:
            return "a single value" if sizes[i] is None else f"{sizes[i]} {what}"

        if bad is None:
            detail = "its rows are not all of one shape"
        else:
            detail = f"sample {bad} has {count(bad)}, sample 0 {count(0)}"
        raise ValueError(
            f"feature {name!r}: {what} are not a rectangular [B, H] array ({detail}); "
            "SparseFeatures.from_ragged takes rows of different lengths"
        ) from None


def _as_int_array(name: str, raw) -> np.ndarray:
    arr = _rectangular(name, "ids", raw)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"feature {name!r}: ids must be an integer array, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.unsignedinteger):
        if arr.size and arr.max() > np.iinfo(np.int64).max:
            raise ValueError(f"feature {name!r}: id {int(arr.max())} does not fit in int64")
        arr = arr.astype(np.int64)
    return arr


def _dtype_of(x) -> np.dtype:
    """An array's or a tracer's dtype (never its values); a list's as numpy reads it."""
    dt = getattr(x, "dtype", None)
    return np.asarray(x).dtype if dt is None else np.dtype(dt)


def _check_weight_dtype(name: str, dt: np.dtype) -> None:
    """Weights are real numbers: a float or integer type (not bool, complex or text)."""
    if not (np.issubdtype(dt, np.floating) or np.issubdtype(dt, np.integer)):
        raise ValueError(f"feature {name!r}: weights must be numeric, got dtype {dt}")


def _as_weight_array(name: str, raw, shape) -> np.ndarray:
    w = _rectangular(name, "weights", raw)
    _check_weight_dtype(name, w.dtype)
    if w.shape != tuple(shape):
        raise ValueError(f"feature {name!r}: weights shape {w.shape} != ids shape {tuple(shape)}")
    return w.astype(np.float32)


def _check_finite(name: str, w: np.ndarray, valid: np.ndarray) -> None:
    bad = valid & ~np.isfinite(w)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"feature {name!r}: weight {w[pos]} at position {pos} is not finite")


# The least denominator a weighted `mean` or `sqrtn` bag may have: its weight sum (mean) or
# the root of its squared weights' sum (sqrtn). The kernels compute in float32 and flush
# results below float32's smallest normal number (2**-126) to zero, so a smaller denominator
# pooled to zeros (weights [1e-45] gave a zero vector, not the row; sqrtn weights [1e-19]
# too). From 2**-60 up, a flushed product w * row changes the pooled value by less than
# 2**-66 per id, and the denominator itself is a normal number.
MIN_POOL_DENOMINATOR = 2.0**-60


def _check_pool_weights(name: str, combiner, w, valid: np.ndarray) -> None:
    """A `mean` bag divides by the sum of its weights, a `sqrtn` bag by the root of the sum
    of their squares. A non-empty mean bag whose weights sum to less than
    `MIN_POOL_DENOMINATOR` (zero or less: no mean at all), or a sqrtn bag with a non-zero
    weight whose norm is below it, would pool to zeros in float32, so it is refused."""
    if w is None or combiner not in (Combiner.MEAN, Combiner.SQRTN):
        return
    w64 = np.where(valid, np.asarray(w, np.float64), 0.0)
    if combiner is Combiner.MEAN:
        den = w64.sum(axis=1)
        bad = valid.any(axis=1) & ~(den >= MIN_POOL_DENOMINATOR)
        what = "weights sum to"
    else:
        den = np.sqrt(np.square(w64).sum(axis=1))
        bad = (den > 0) & (den < MIN_POOL_DENOMINATOR)
        what = "weights' root sum of squares is"
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(
            f"feature {name!r}: sample {b}'s {what} {float(den[b]):.7g}; a {combiner.value} "
            f"combiner needs at least 2**-60 (about {MIN_POOL_DENOMINATOR:.2g}) for every "
            "non-empty bag (float32 pools a smaller one to zeros)"
        )


class _Parts:
    """The checked per-feature arrays a constructor collects, then builds into one batch."""

    def __init__(self):
        self.ids, self.lengths, self.weights = {}, {}, {}

    def add(self, name, packed, lengths, w, config) -> None:
        self.ids[name], self.lengths[name], w = _finish(name, packed, lengths, w, config)
        if w is not None:
            self.weights[name] = w

    def build(self, cls, config):
        return _checked(cls(ids=self.ids, lengths=self.lengths, weights=self.weights), config)


def _finish(name, packed, lengths, w, config):
    """Range/hotness checks and the final dtype and width of one feature."""
    valid = np.arange(packed.shape[1])[None, :] < lengths[:, None]
    if (packed[valid] < 0).any():
        pos = tuple(int(i) for i in np.argwhere(valid & (packed < 0))[0])
        raise ValueError(f"feature {name!r}: negative id {int(packed[pos])} at position {pos}")
    width = packed.shape[1]
    if config is not None:
        fc = config.feature_by_name[name]
        table = config.table_by_name[fc.table]
        if lengths.size and lengths.max() > fc.max_hotness:
            b = int(np.argmax(lengths))
            raise ValueError(
                f"feature {name!r}: sample {b} has {int(lengths[b])} ids, above max_hotness "
                f"{fc.max_hotness}"
            )
        _check_pool_weights(name, fc.combiner, w, valid)
        too_big = valid & (packed >= table.vocab_size)
        if too_big.any():
            pos = tuple(int(i) for i in np.argwhere(too_big)[0])
            raise ValueError(
                f"feature {name!r}: id {int(packed[pos])} at position {pos} is out of range for "
                f"table {table.name!r} (vocab_size {table.vocab_size})"
            )
        width = fc.max_hotness
    if packed.shape[1] > width:
        packed = packed[:, :width]
        if w is not None:
            w = w[:, :width]
    elif packed.shape[1] < width:
        extra = width - packed.shape[1]
        packed = np.pad(packed, ((0, 0), (0, extra)), constant_values=PAD)
        if w is not None:
            w = np.pad(w, ((0, 0), (0, extra)))
    packed = _to_id_dtype(name, packed)
    if config is not None and config.feature_by_name[name].weighted and w is None:
        w = np.where(packed >= 0, 1.0, 0.0)
    out_w = None if w is None else np.asarray(w, np.float32)
    return packed, lengths.astype(np.int32), out_w


def _to_id_dtype(name: str, arr: np.ndarray) -> np.ndarray:
    if jax.config.jax_enable_x64:
        return arr.astype(np.int64) if arr.dtype.itemsize > 4 else arr.astype(np.int32)
    if arr.size and arr.max() > _INT32_MAX:
        pos = tuple(int(i) for i in np.argwhere(arr > _INT32_MAX)[0])
        raise ValueError(
            f"feature {name!r}: id {int(arr[pos])} at position {pos} needs 64-bit ids; enable "
            "jax_enable_x64 (jax.config.update('jax_enable_x64', True)) before building batches"
        )
    return arr.astype(np.int32)
