"""Tables in logical form <-> the stacked group buffers of a plan.

A table's logical form is its `[V, d]` rows in id order (and its optimizer slots the same
way), independent of any plan: checkpoints and single-table export use it. Reading gathers
only the blocks a table's shards live in; writing updates one device's block in place, so no
host ever builds a whole group buffer. Where each id's row lives is asked of the lowered
plan's `ShardLayout` (`Lowered.layout`, `Lowered.shard_ids`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from embark_jax.core.plan import Cluster
from embark_jax.sharding.lowering import Lowered

__all__ = ["table_arrays", "write_table"]


def _block(arr: jax.Array, g: int) -> np.ndarray:
    """Device g's block `arr[g]` on the host (only that block is transferred)."""
    for s in arr.addressable_shards:
        if s.index[0].start == g or (s.index[0].start is None and arr.shape[0] == 1):
            return np.asarray(s.data)[0]
    raise RuntimeError(f"device {g}'s block is not addressable from this process")


def _gathered(arr: jax.Array):
    if arr.is_fully_addressable:
        return functools.partial(_block, arr)
    full = np.asarray(multihost_utils.process_allgather(arr, tiled=True))  # other processes
    return lambda g: full[g]


def _slot_leaves(state) -> dict[str, jax.Array]:
    return dict(zip(getattr(state, "_fields", ()), state, strict=True))


def table_arrays(lowered: Lowered, name: str, buffers: dict, states: dict) -> dict[str, Any]:
    """One table and its optimizer slots as host arrays in id order."""
    group = lowered.group_of(name)
    tp = lowered.plan.table(name)
    t = lowered.table(name)
    layout = lowered.layout(name)
    get = _gathered(buffers[group.name])
    table = np.zeros((t.vocab_size, t.dim), get(0).dtype)
    slot_get = {k: _gathered(v) for k, v in _slot_leaves(states.get(group.name, ())).items()}
    slots: dict[str, np.ndarray] = {}
    for s in group.shards:
        if s.table != name or (tp.cluster is Cluster.DP and s.device != 0):
            continue
        rows = slice(s.row_offset, s.row_offset + s.rows)
        ids, cols = lowered.shard_ids(s), layout.columns(s.k)
        table[ids, cols] = get(s.device)[rows]
        for k, fn in slot_get.items():
            block = fn(s.device)
            if block.ndim == 0:  # a per-device counter (Adam): the same on every device
                slots[k] = np.asarray(block)
                continue
            if k not in slots:
                shape = (t.vocab_size, t.dim) if block.ndim == 2 else (t.vocab_size,)
                slots[k] = np.zeros(shape, block.dtype)
            if block.ndim == 2:
                slots[k][ids, cols] = block[rows]
            elif s.k == 0:  # row-wise slots: one value per row, held by every column slice
                slots[k][ids] = block[rows]
    return {"table": table, "slots": slots}


@functools.lru_cache(maxsize=64)
def _writer(mesh, spec, ndim: int):
    axes = spec[0]

    def body(block, update, g, off):
        me = jax.lax.axis_index(axes)
        start = (off,) + (0,) * (ndim - 2)
        new = jax.lax.dynamic_update_slice(block[0], update.astype(block.dtype), start)
        return jnp.where(me == g, new, block[0])[None]

    rep = P()
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, rep, rep, rep), out_specs=spec),
        donate_argnums=0,
    )


def _write(buf: jax.Array, update: np.ndarray, g: int, off: int) -> jax.Array:
    """`buf[g, off:off + len(update)] = update`, in place, on device g only (no gathers)."""
    sh = buf.sharding
    return _writer(sh.mesh, sh.spec, buf.ndim)(buf, np.asarray(update), np.int32(g), np.int32(off))


def write_table(
    lowered: Lowered, name: str, arrays: dict[str, Any], buffers: dict, states: dict
) -> None:
    """Writes one table (and slots) in id order into the group buffers, in place."""
    group = lowered.group_of(name)
    table = np.asarray(arrays["table"])
    want = (lowered.table(name).vocab_size, lowered.table(name).dim)
    if table.shape != want:
        raise ValueError(f"table {name!r}: checkpoint shape {table.shape} != configured {want}")
    state = states.get(group.name)
    fields = list(getattr(state, "_fields", ()))
    leaves = dict(zip(fields, state, strict=True)) if state is not None else {}
    missing = sorted(set(fields) - set(arrays.get("slots", {})))
    if missing:
        raise ValueError(
            f"table {name!r}: checkpoint has no optimizer slots {missing} "
            "(saved with another optimizer?)"
        )
    layout = lowered.layout(name)
    for s in group.shards:
        if s.table != name:
            continue
        ids, cols = lowered.shard_ids(s), layout.columns(s.k)
        buffers[group.name] = _write(buffers[group.name], table[ids, cols], s.device, s.row_offset)
        for k in fields:
            v = np.asarray(arrays["slots"][k])
            leaf = leaves[k]
            if leaf.ndim == 1:  # per-device counter
                leaves[k] = leaf.at[s.device].set(v.astype(leaf.dtype))
            elif leaf.ndim == 3:
                leaves[k] = _write(leaf, v[ids, cols], s.device, s.row_offset)
            else:
                leaves[k] = _write(leaf, v[ids], s.device, s.row_offset)
    if state is not None:
        states[group.name] = type(state)(*[leaves[k] for k in fields])
