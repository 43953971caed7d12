"""The on-device bounds check of ids against their own table (`docs/design.md` §6).

Tables are stacked into shared buffers (§4), so an id >= its table's `vocab_size` would index
the rows of whatever is stacked after it: another table. Host-side validation
(`SparseFeatures` constructors given a config, `SparseFeatures.validate`) catches such ids
before they reach a device, but a batch built without a config is not checked there. The run
time therefore checks every id against its own table on device, before routing, like
TorchRec's bounds-check modes:

* an id is **invalid** if it is `< -1` or `>= vocab_size` of the feature's table (-1 is
  padding, the layout's empty slot);
* an invalid id is dropped exactly like padding: it contributes nothing to any output (nor to
  a `mean` / `sqrtn` divisor) and updates nothing;
* invalid ids are counted per table (summed over the features of the table) and reported
  beside the overflow counts; `OverflowPolicy.ERROR` turns a non-zero count into an
  `InvalidIdError` (see `embark_jax.sharding.collection`).

A hand-built batch takes the ops' id rules (`embark_jax.ops.ids`) too. On the host, before
it reaches a device (`EmbeddingCollection.shard_batch`, `lookup`, `apply_gradients`), its
numpy ids of a type JAX does not hold (int64 or unsigned 32/64-bit with 64-bit types off)
are converted by value, or refused with the feature's name and the id (`host_batch`), and
its layout is checked: JAX itself would wrap an int64 id of 2**32 + 5 to row 5, which this
check could not tell from a valid id. Under a caller's own `jit` the same refusal happens
when JAX flattens the batch (`SparseFeatures`' pytree flatten), before it converts it. On the device, ids of a narrower type (int8, int16,
uint8, uint16) are widened to int32, and uint32 ids without `jax_enable_x64` and uint64 ids
are refused, as they could wrap.

Runs per device inside `shard_map`: one compare and select per id slot.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from embark_jax.core.specs import EmbeddingConfig
from embark_jax.data.sparse import PAD, SparseFeatures
from embark_jax.ops.ids import holds_jax_arrays, host_id_array, widen_ids

__all__ = ["CheckedBatch", "bounds_check", "check_batch", "host_batch", "invalid_mask"]


def host_batch(batch: SparseFeatures) -> SparseFeatures:
    """`batch` as a device may take it: host ids converted by value (`host_id_array`), host
    lengths and weights given as lists made arrays. Device arrays, and tracers under the
    caller's `jit`, are left as they are: JAX has already converted those (at a `jit`
    boundary after flattening the batch, where `SparseFeatures` refuses host values that
    would wrap). The layout is the caller's to check next (`SparseFeatures.check_layout`)."""
    ids = {n: host_id_array(f"feature {n!r}: ids", v) for n, v in batch.ids.items()}
    lengths = {n: _host_array(f"feature {n!r}: lengths", v) for n, v in batch.lengths.items()}
    weights = {n: _host_array(f"feature {n!r}: weights", v) for n, v in batch.weights.items()}
    return SparseFeatures(ids, lengths, weights)


def _host_array(field: str, x):
    """An array as it is; a (nested) list as a JAX array when it holds JAX arrays (tracers
    under `jit`), else as a numpy array; a ragged one is refused naming `field`."""
    if isinstance(x, (jax.Array, np.ndarray)):
        return x
    if holds_jax_arrays(x):
        return jnp.asarray(x)
    try:
        return np.asarray(x)
    except ValueError as e:  # numpy: a ragged list
        raise ValueError(f"{field}: not a rectangular array ({e})") from None


def invalid_mask(ids: jax.Array, vocab_size: int) -> jax.Array:
    """Ids that are neither padding (-1) nor a row of a table of `vocab_size` rows."""
    return (ids < PAD) | (ids >= vocab_size)


@dataclasses.dataclass(frozen=True)
class CheckedBatch:
    """A device's batch after the bounds check: per feature (`features`), and every
    feature's ids flat in one array, one feature after the other in the order checked (a
    group's features side by side, so that a group takes its ids as one slice)."""

    features: SparseFeatures
    ids: jax.Array  # [N] the checked ids of every feature, flat
    spans: Mapping[str, tuple[int, int]]  # feature -> (first slot in `ids`, slots)

    def flat_ids(self, names: Sequence[str]) -> jax.Array:
        """The checked ids of the features `names`, one after the other."""
        spans = [self.spans[n] for n in names]
        if all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(spans)):
            return self.ids[spans[0][0] : spans[-1][0] + spans[-1][1]]
        return jnp.concatenate([self.ids[s : s + z] for s, z in spans])


def bounds_check(
    config: EmbeddingConfig, tables: Sequence[str], batch: SparseFeatures
) -> tuple[SparseFeatures, jax.Array]:
    """`(batch with invalid ids replaced by padding, invalid count per table)`.

    The counts are `[len(tables)]` int32 in the order of `tables`, for this (local) batch.
    Weights of invalid slots become 0 and lengths count only the valid ids left.
    """
    checked, counts = check_batch(config, tables, batch)
    return checked.features, counts


def check_batch(
    config: EmbeddingConfig,
    tables: Sequence[str],
    batch: SparseFeatures,
    order: Sequence[str] | None = None,
) -> tuple[CheckedBatch, jax.Array]:
    """`bounds_check` as a `CheckedBatch` whose flat ids follow `order` (default: the
    batch's features). All features are checked at once, each slot against its own
    table's last row (a small per-feature table indexed by each slot's feature), so the
    check's operations do not grow with the number of features."""
    names = list(batch.feature_names if order is None else order)
    if not names:
        return CheckedBatch(batch, jnp.zeros((0,), jnp.int32), {}), jnp.zeros(
            (len(tables),), jnp.int32
        )
    xs = [widen_ids(f"feature {n!r}: ids", jnp.asarray(batch.ids[n])) for n in names]
    flat = jnp.concatenate([x.reshape(-1) for x in xs])
    feats = [config.feature_by_name[n] for n in names]
    # last valid row of each feature's table, capped at the ids' largest value (a larger
    # table admits every non-negative id)
    top = np.iinfo(flat.dtype).max
    last = [min(config.table_by_name[f.table].vocab_size - 1, top) for f in feats]
    sizes = np.array([x.size for x in xs])
    # per-slot tables as numpy constants: XLA would fold them from the sizes, slowly
    feature = np.repeat(np.arange(len(names), dtype=np.int32), sizes)
    bad = (flat < PAD) | (flat > jnp.asarray(np.array(last, flat.dtype)[feature]))
    index = np.array([list(tables).index(f.table) for f in feats], np.int32)
    table = jnp.asarray(index[feature])
    counts = jnp.zeros((len(tables),), jnp.int32).at[table].add(bad.astype(jnp.int32))
    fixed = jnp.where(bad, jnp.asarray(PAD, flat.dtype), flat)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    spans = {n: (int(s), int(z)) for n, s, z in zip(names, starts, sizes, strict=True)}
    checked = CheckedBatch(_split_checked(batch, names, xs, fixed, bad), fixed, spans)
    return checked, counts


def _split_checked(batch, names, xs, fixed, bad) -> SparseFeatures:
    """The checked batch per feature from the concatenated ids and invalid mask."""
    ids, lengths, weights = {}, {}, {}
    start = 0
    for name, x in zip(names, xs, strict=True):
        end = start + x.size
        f_bad = bad[start:end].reshape(x.shape)
        ids[name] = fixed[start:end].reshape(x.shape).astype(x.dtype)
        n_bad = jnp.sum(f_bad, axis=-1, dtype=jnp.int32)
        length = jnp.asarray(batch.lengths[name])
        lengths[name] = length - n_bad.astype(length.dtype)
        if name in batch.weights:
            w = jnp.asarray(batch.weights[name])
            weights[name] = jnp.where(f_bad, jnp.zeros((), w.dtype), w)
        start = end
    return SparseFeatures(ids, lengths, weights)
