"""Dynamic tables in logical form: what checkpoints store and serving reads, whatever the
shard count (docs/design.md §11, "Checkpoints and delta export").

`LogicalDynamicTable` holds a table's live entries sorted by id (as unsigned 64-bit
values): ids, rows, per-row optimizer slots and scores (last step seen, times seen).
`export_logical` gathers it from the stacked shards (one host copy of each field, numpy,
no loop over ids); `import_logical` places it onto any number of shards, each id on the
shard and in the bucket the hash gives it, the occupied slots of each bucket a prefix (in
ascending id order), so that `find` finds every id at the row it was saved with.
`delta_since` is the rows seen (so updated) by training at or after a step.

Not saved: entries expired under a TTL (they find nothing), and admission candidates (ids
seen fewer times than the threshold): their counts are soft state, and an id under
admission starts counting again after a restore. An import that does not fit (a bucket
receives more ids than it has slots) is a one-line `ValueError` naming the table, shard and
bucket: nothing is dropped silently.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from embark_jax.core.dynamic import (
    EMPTY_WORD,
    DynamicTableConfig,
    hash_words,
    join_key_words,
    key_words,
    shard_of,
)
from embark_jax.ops.hash_table import DynamicTableState
from embark_jax.ops.optimizers import SparseOptimizer

__all__ = ["LogicalDynamicTable", "delta_since", "export_logical", "import_logical"]


class LogicalDynamicTable(NamedTuple):
    """A dynamic table's live entries, sorted by id (unsigned order)."""

    ids: np.ndarray  # [N] int64, the 64-bit ids (`join_key_words`)
    values: np.ndarray  # [N, dim], the table's dtype
    slots: dict[str, np.ndarray]  # optimizer field -> [N, ...] per-row slot of each id
    scores: np.ndarray  # [N, 2] int32: (last step seen, times seen)
    step: int  # the latest training step that looked the table up

    def as_tree(self) -> dict[str, Any]:
        """The arrays as one dict (what a checkpoint writes)."""
        return {
            "ids": self.ids,
            "values": self.values,
            "scores": self.scores,
            "step": np.asarray(self.step, np.int64),
            **{f"slot_{k}": v for k, v in self.slots.items()},
        }

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> LogicalDynamicTable:
        slots = {k[5:]: np.asarray(v) for k, v in tree.items() if k.startswith("slot_")}
        return cls(
            np.asarray(tree["ids"], np.int64),
            np.asarray(tree["values"]),
            slots,
            np.asarray(tree["scores"], np.int32),
            int(tree["step"]),
        )


def _host(x) -> np.ndarray:
    """A (possibly multi-process) device array as one numpy array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _per_row(opt_state, capacity: int, lead: int) -> dict[str, Any]:
    """The optimizer state's per-row fields (axis `lead` of length `capacity`)."""
    fields = opt_state._asdict() if hasattr(opt_state, "_asdict") else {}
    return {k: v for k, v in fields.items() if v.ndim > lead and v.shape[lead] == capacity}


def _check_state(state, config: DynamicTableConfig, where: str) -> None:
    """`state` is stacked shards of `config`'s table: `[G, capacity, 2]` keys and
    `[G, capacity, dim]` values of its dtype (a one-line `ValueError` otherwise)."""
    if not isinstance(config, DynamicTableConfig):
        raise ValueError(
            f"{where}: config must be a DynamicTableConfig, got {type(config).__name__}"
        )
    if not isinstance(state, DynamicTableState):
        raise ValueError(f"{where}: state must be a DynamicTableState, got {type(state).__name__}")
    keys, values = np.shape(state.keys), np.shape(state.values)
    want = (config.capacity, config.dim)
    if len(keys) != 3 or len(values) != 3 or (keys[1], values[2]) != want:
        raise ValueError(
            f"{where}: table {config.name!r} has capacity {config.capacity} and dim "
            f"{config.dim} per shard; the state holds keys {list(keys)} and values "
            f"{list(values)} (stacked shards [G, capacity, ...] of another table?)"
        )
    if np.dtype(state.values.dtype) != np.dtype(config.dtype):
        raise ValueError(
            f"{where}: table {config.name!r} is {np.dtype(config.dtype)}, the state's values "
            f"are {np.dtype(state.values.dtype)}"
        )


def export_logical(state: DynamicTableState, config: DynamicTableConfig) -> LogicalDynamicTable:
    """The live entries of the stacked shards `state` (every leaf `[G, ...]`; one of
    another capacity, dim or dtype than `config` is a one-line `ValueError`). A replicated
    table's `G` equal copies give each id once."""
    _check_state(state, config, "export_logical")
    keys, scores = _host(state.keys), _host(state.scores)
    steps = _host(state.step).reshape(-1)
    empty = (keys[..., 0] == EMPTY_WORD) & (keys[..., 1] == EMPTY_WORD)
    live = ~empty
    if config.ttl:
        live &= (steps[:, None] - scores[..., 0]) <= config.ttl
    words = keys[live]
    order = np.lexsort((words[:, 0], words[:, 1]))  # (high, low): unsigned 64-bit order
    ws = words[order]  # a replicated table's copies of an id: the first (they are equal)
    first = np.ones(len(ws), bool)
    first[1:] = np.any(ws[1:] != ws[:-1], axis=1)
    order = order[first]
    slots = {
        k: _host(v)[live][order] for k, v in _per_row(state.opt_state, config.capacity, 1).items()
    }
    return LogicalDynamicTable(
        ids=join_key_words(words[order]),
        values=_host(state.values)[live][order],
        slots=slots,
        scores=scores[live][order].astype(np.int32),
        step=int(steps.max()) if steps.size else 0,
    )


def _check(logical: LogicalDynamicTable, config: DynamicTableConfig, num_shards) -> None:
    where = f"dynamic table {config.name!r}"
    if isinstance(num_shards, bool) or not isinstance(num_shards, int | np.integer):
        raise ValueError(f"{where}: num_shards must be an int >= 1, got {num_shards!r}")
    if num_shards < 1:
        raise ValueError(f"{where}: num_shards must be an int >= 1, got {num_shards}")
    n = logical.ids.shape[0]
    if logical.values.shape != (n, config.dim) or logical.values.dtype != config.dtype:
        raise ValueError(
            f"{where}: values must be {config.dtype}[{n}, {config.dim}], got "
            f"{logical.values.dtype}{list(logical.values.shape)}"
        )
    if logical.scores.shape != (n, 2):
        raise ValueError(f"{where}: scores must be [{n}, 2], got {list(logical.scores.shape)}")
    if n and (logical.ids == -1).any():
        raise ValueError(f"{where}: ids hold the padding id -1")
    if np.unique(logical.ids).size != n:
        raise ValueError(f"{where}: ids must be distinct, {n - np.unique(logical.ids).size} repeat")


def import_logical(
    logical: LogicalDynamicTable,
    config: DynamicTableConfig,
    num_shards: int,
    optimizer: SparseOptimizer | None = None,
) -> DynamicTableState:
    """Stacked numpy shards (every leaf `[num_shards, ...]`) holding `logical`'s entries:
    each id on `shard_of(id)`, in its hash bucket, the bucket's entries a prefix in id
    order; free slots empty with zero rows and the optimizer's initial slots; no
    admission candidates; every shard's step `logical.step`."""
    _check(logical, config, num_shards)
    g, c, s, nb = num_shards, config.capacity, config.bucket_size, config.num_buckets
    words = key_words(logical.ids)
    shard = shard_of(words, g).astype(np.int64)
    bucket = (hash_words(words)[:, 0] % np.uint32(nb)).astype(np.int64)
    group = shard * nb + bucket
    order = np.argsort(group, kind="stable")  # ids are sorted: id order inside a bucket
    first = np.searchsorted(group[order], group[order], side="left")
    pos = np.empty_like(group)
    pos[order] = np.arange(group.size) - first
    over = pos >= s
    if over.any():
        bad, counts = np.unique(group[over], return_counts=True)
        k = int(np.argmax(counts))
        raise ValueError(
            f"dynamic table {config.name!r}: {int(over.sum())} ids do not fit their buckets "
            f"on {g} shards of {c} slots (e.g. shard {int(bad[k] // nb)}, bucket "
            f"{int(bad[k] % nb)}: {int(counts[k])} more than its {s} slots)"
        )
    slot = bucket * s + pos
    keys = np.full((g, c, 2), EMPTY_WORD, np.uint32)
    scores = np.zeros((g, c, 2), np.int32)
    values = np.zeros((g, c, config.dim), config.dtype)
    keys[shard, slot], scores[shard, slot] = words, logical.scores
    values[shard, slot] = logical.values
    opt = _initial_opt(config, g, optimizer)
    for k, v in _per_row(opt, c, 1).items():
        v[shard, slot] = logical.slots[k]
    a = nb * config.admission_candidates
    return DynamicTableState(
        keys=keys,
        scores=scores,
        cand_keys=np.full((g, a, 2), EMPTY_WORD, np.uint32),
        cand_scores=np.zeros((g, a, 2), np.int32),
        values=values,
        opt_state=opt,
        step=np.full((g,), logical.step, np.int32),
    )


def _initial_opt(config: DynamicTableConfig, num_shards: int, optimizer) -> Any:
    """The optimizer's fresh state of one shard, stacked `num_shards` times (writable)."""
    if optimizer is None:
        return ()
    one = optimizer.init(np.zeros((config.capacity, config.dim), config.dtype))
    return jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], num_shards, axis=0), one)


def delta_since(
    state: DynamicTableState, config: DynamicTableConfig, since_step: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(ids [K] int64, values [K, dim])`, sorted by id: the live rows seen by a training
    step `>= since_step` (an id a step looks up gets its row updated by that step, when the
    step commits), for serving or online training."""
    _check_state(state, config, "delta_since")
    if isinstance(since_step, bool) or not isinstance(since_step, int | np.integer):
        raise ValueError(f"delta_since: since_step must be an int, got {since_step!r}")
    logical = export_logical(state, config)
    keep = logical.scores[:, 0] >= int(since_step)
    return logical.ids[keep], logical.values[keep]
