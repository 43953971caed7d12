"""Checkpoints with Orbax that reshard across plans, device counts and processes.

A checkpoint stores every table and its optimizer slots in *logical* form (`[V, d]` rows in
id order), so it does not depend on the plan that wrote it, next to the dense parameters and
optax state, the step, the data position and the plan (for reference):

    <dir>/step_00000100/meta.json          format, step, data position, plan, table specs
    <dir>/step_00000100/dense/             Orbax: dense params + optax state
    <dir>/step_00000100/tables/<name>/     Orbax: {"table": [V, d], "slots": {...}}

Saving and restoring stream table by table: at most one table (and its slots) is on the host
at a time; restoring writes each table's rows straight into the new plan's device buffers.
A save goes to `step_N.tmp-*` and is renamed when complete, so a crash mid-save leaves the
previous checkpoint usable (and `latest_step` never sees a partial one). `save_async`
writes in a background thread from an on-device snapshot while training continues.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
import types
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from embark_jax.core.plan import Cluster, Plan
from embark_jax.sharding.lowering import Lowered

__all__ = [
    "FORMAT",
    "PendingSave",
    "export_table",
    "import_table",
    "latest_step",
    "restore",
    "save",
    "save_async",
]

FORMAT = "embark-ckpt/1"


def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def latest_step(directory: str) -> int | None:
    """The newest complete checkpoint's step in `directory` (None if there is none)."""
    if not os.path.isdir(directory):
        return None
    steps = [
        int(n[5:])
        for n in os.listdir(directory)
        if n.startswith("step_")
        and n[5:].isdigit()
        and os.path.exists(os.path.join(directory, n, "meta.json"))
    ]
    return max(steps) if steps else None


# --- table <-> group buffers --------------------------------------------------------------


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
    get = _gathered(buffers[group.name])
    table = np.zeros((t.vocab_size, t.dim), get(0).dtype)
    slot_get = {k: _gathered(v) for k, v in _slot_leaves(states.get(group.name, ())).items()}
    slots: dict[str, np.ndarray] = {}
    for s in group.shards:
        if s.table != name or (tp.cluster is Cluster.DP and s.device != 0):
            continue
        rows = slice(s.row_offset, s.row_offset + s.rows)
        ids = slice(s.j if tp.cluster is not Cluster.DP else 0, None, tp.row_shards)
        cols = slice(s.col_start, s.col_start + s.width)
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
    tp = lowered.plan.table(name)
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
    for s in group.shards:
        if s.table != name:
            continue
        ids = slice(s.j if tp.cluster is not Cluster.DP else 0, None, tp.row_shards)
        cols = slice(s.col_start, s.col_start + s.width)
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


# --- save / restore -----------------------------------------------------------------------


class PendingSave:
    """An asynchronous save in flight: `wait()` blocks until it is on disk (and re-raises
    its error, if any); `path` is where it will be."""

    def __init__(self, path: str, thread: threading.Thread, box: dict):
        self.path, self._thread, self._box = path, thread, box

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        self._thread.join()
        if "error" in self._box:
            raise self._box["error"]
        return self.path


def save_async(
    directory: str,
    trainer,
    *,
    step: int | None = None,
    data_position: int | None = None,
    max_to_keep: int | None = 3,
) -> PendingSave:
    """Like `save`, but writes in a background thread while training goes on.

    The state is first copied on the devices (training donates its buffers at the next
    step), which costs one extra copy of the tables and slots in device memory until the
    save is done. Single-process runs only (the multi-process save synchronises processes).
    """
    if jax.process_count() > 1:
        raise ValueError("asynchronous saves are single-process only; use save()")
    step = int(trainer.state["step"]) if step is None else step
    snapshot = jax.block_until_ready(jax.tree.map(jnp.copy, trainer.state))
    frozen = types.SimpleNamespace(state=snapshot, collection=trainer.collection)
    box: dict = {}

    def run():
        try:
            save(directory, frozen, step=step, data_position=data_position, max_to_keep=max_to_keep)
        except BaseException as e:  # surfaced by wait()
            box["error"] = e

    thread = threading.Thread(target=run, name=f"embark-ckpt-{step}", daemon=True)
    thread.start()
    return PendingSave(_step_dir(directory, step), thread, box)


def save(
    directory: str,
    trainer,
    *,
    step: int | None = None,
    data_position: int | None = None,
    max_to_keep: int | None = 3,
) -> str:
    """Saves the trainer's whole state; returns the checkpoint directory."""
    step = int(trainer.state["step"]) if step is None else step
    final = _step_dir(directory, step)
    lead = jax.process_index() == 0
    tag = multihost_utils.broadcast_one_to_all(np.int64(uuid.uuid4().int % (1 << 62)))
    tmp = f"{final}.tmp-{int(tag):x}"
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(
        os.path.join(tmp, "dense"),
        {"params": trainer.state["dense"], "opt": trainer.state["dense_opt"]},
    )
    lowered = trainer.collection.lowered
    tables_meta = {}
    for tp in lowered.plan.tables:
        arrays = table_arrays(lowered, tp.name, trainer.state["emb"], trainer.state["emb_opt"])
        ckptr.save(os.path.join(tmp, "tables", tp.name), arrays)
        ckptr.wait_until_finished()  # one table on the host at a time
        t = lowered.table(tp.name)
        opt = lowered.group_of(tp.name).optimizer or trainer.collection.optimizer
        tables_meta[tp.name] = {
            "vocab_size": t.vocab_size,
            "dim": t.dim,
            "dtype": str(np.dtype(arrays["table"].dtype)),
            "optimizer": type(opt).__name__ if opt else None,
            "slots": sorted(arrays["slots"]),
        }
    ckptr.wait_until_finished()
    if lead:
        meta = {
            "format": FORMAT,
            "step": step,
            "data_position": step if data_position is None else data_position,
            "plan": lowered.plan.to_dict(),
            "tables": tables_meta,
        }
        with open(os.path.join(tmp, "meta.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)  # the checkpoint exists only once complete
        if max_to_keep:
            steps = sorted(
                int(n[5:])
                for n in os.listdir(directory)
                if n.startswith("step_") and n[5:].isdigit()
            )
            for old in steps[:-max_to_keep]:
                shutil.rmtree(_step_dir(directory, old), ignore_errors=True)
    multihost_utils.sync_global_devices(f"embark-ckpt-save-{step}")
    return final


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "meta.json")) as fh:
        meta = json.load(fh)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unsupported checkpoint format {meta.get('format')!r}")
    return meta


def restore(directory: str, trainer, *, step: int | None = None) -> dict[str, Any]:
    """Restores a checkpoint into `trainer`, whatever plan, device count or process count
    it was saved with (the trainer's own plan is kept). Returns the checkpoint's meta
    (`step`, `data_position`, `plan`, ...)."""
    step = latest_step(directory) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint in {directory}")
    path = _step_dir(directory, step)
    meta = read_meta(path)
    lowered = trainer.collection.lowered
    for tp in lowered.plan.tables:
        if tp.name not in meta["tables"]:
            raise ValueError(f"checkpoint {path} has no table {tp.name!r}")
        saved, t = meta["tables"][tp.name], lowered.table(tp.name)
        if (saved["vocab_size"], saved["dim"]) != (t.vocab_size, t.dim):
            raise ValueError(
                f"table {tp.name!r}: checkpoint is [{saved['vocab_size']}, "
                f"{saved['dim']}], configured [{t.vocab_size}, {t.dim}]"
            )
    ckptr = ocp.StandardCheckpointer()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        {"params": trainer.state["dense"], "opt": trainer.state["dense_opt"]},
    )
    dense = ckptr.restore(os.path.join(path, "dense"), abstract)
    buffers = dict(trainer.state["emb"])
    states = dict(trainer.state["emb_opt"])
    for tp in lowered.plan.tables:
        arrays = ckptr.restore(os.path.join(path, "tables", tp.name))
        write_table(lowered, tp.name, arrays, buffers, states)
    rep = trainer.state["step"].sharding
    trainer.state = {
        "dense": dense["params"],
        "dense_opt": dense["opt"],
        "emb": buffers,
        "emb_opt": states,
        "step": jax.device_put(np.int32(meta["step"]), rep),
    }
    trainer.last_checkpoint = path
    meta["path"] = path
    meta["plan"] = Plan.from_dict(meta["plan"])
    return meta


# --- single tables <-> numpy ------------------------------------------------------------


def export_table(trainer, name: str, path: str) -> None:
    """Writes one table to `path`: `.npy` (the table) or `.npz` (table and slots)."""
    arrays = table_arrays(
        trainer.collection.lowered, name, trainer.state["emb"], trainer.state["emb_opt"]
    )
    if path.endswith(".npz"):
        np.savez(
            path, table=arrays["table"], **{f"slot_{k}": v for k, v in arrays["slots"].items()}
        )
    else:
        np.save(path, arrays["table"])


def import_table(trainer, name: str, path: str) -> None:
    """Loads one table (e.g. pretrained embeddings) from `.npy`/`.npz` into the trainer;
    slots found in an `.npz` are loaded too, others keep their values."""
    lowered = trainer.collection.lowered
    current = table_arrays(lowered, name, trainer.state["emb"], trainer.state["emb_opt"])
    if path.endswith(".npz"):
        with np.load(path) as z:
            arrays = {
                "table": z["table"],
                "slots": {k[5:]: z[k] for k in z.files if k.startswith("slot_")},
            }
        arrays["slots"] = {**current["slots"], **arrays["slots"]}
    else:
        arrays = {"table": np.load(path), "slots": current["slots"]}
    buffers, states = dict(trainer.state["emb"]), dict(trainer.state["emb_opt"])
    write_table(lowered, name, arrays, buffers, states)
    trainer.state = {**trainer.state, "emb": buffers, "emb_opt": states}
