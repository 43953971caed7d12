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

Functions take a `TrainSetup` and a `TrainState` and never change the state they are given:
`restore` and `import_table` build and return a new one (the caller swaps it in when it is
complete), so a failed restore leaves the live state usable.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from embark_jax.core.plan import Plan
from embark_jax.sharding.lowering import Lowered
from embark_jax.training.loop import CallbackBase
from embark_jax.training.runner import StepRunner
from embark_jax.training.state import TrainSetup, TrainState, init_slots
from embark_jax.training.table_io import table_arrays, write_table

__all__ = [
    "FORMAT",
    "CheckpointEvery",
    "PendingSave",
    "export_table",
    "import_table",
    "latest_step",
    "restore",
    "save",
    "save_async",
]

FORMAT = "embark-ckpt/2"  # /2: the dense part holds the RNG key too


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
    setup: TrainSetup,
    state: TrainState,
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
    step = int(state.step) if step is None else step
    snapshot = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    box: dict = {}

    def run():
        try:
            save(
                directory,
                setup,
                snapshot,
                step=step,
                data_position=data_position,
                max_to_keep=max_to_keep,
            )
        except BaseException as e:  # surfaced by wait()
            box["error"] = e

    thread = threading.Thread(target=run, name=f"embark-ckpt-{step}", daemon=True)
    thread.start()
    return PendingSave(_step_dir(directory, step), thread, box)


def _dense_tree(state: TrainState) -> dict[str, Any]:
    return {"params": state.dense_params, "opt": state.dense_opt, "rng": state.rng}


def _table_meta(setup: TrainSetup, name: str, arrays: dict[str, Any]) -> dict[str, Any]:
    t = setup.lowered.table(name)
    opt = setup.lowered.group_of(name).optimizer
    return {
        "vocab_size": t.vocab_size,
        "dim": t.dim,
        "dtype": str(np.dtype(arrays["table"].dtype)),
        "optimizer": type(opt).__name__ if opt else None,
        "slots": sorted(arrays["slots"]),
    }


def save(
    directory: str,
    setup: TrainSetup,
    state: TrainState,
    *,
    step: int | None = None,
    data_position: int | None = None,
    max_to_keep: int | None = 3,
) -> str:
    """Saves the whole training state; returns the checkpoint directory."""
    step = int(state.step) if step is None else step
    final = _step_dir(directory, step)
    tag = multihost_utils.broadcast_one_to_all(np.int64(uuid.uuid4().int % (1 << 62)))
    tmp = f"{final}.tmp-{int(tag):x}"
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(tmp, "dense"), _dense_tree(state))
    lowered = setup.lowered
    tables_meta = {}
    for tp in lowered.plan.tables:
        arrays = table_arrays(lowered, tp.name, state.tables, state.slots)
        ckptr.save(os.path.join(tmp, "tables", tp.name), arrays)
        ckptr.wait_until_finished()  # one table on the host at a time
        tables_meta[tp.name] = _table_meta(setup, tp.name, arrays)
    ckptr.wait_until_finished()
    if jax.process_index() == 0:
        meta = {
            "format": FORMAT,
            "step": step,
            "data_position": step if data_position is None else data_position,
            "plan": lowered.plan.to_dict(),
            "tables": tables_meta,
        }
        _commit(directory, tmp, final, meta, max_to_keep)
    multihost_utils.sync_global_devices(f"embark-ckpt-save-{step}")
    return final


def _commit(directory: str, tmp: str, final: str, meta: dict, max_to_keep: int | None) -> None:
    """Writes meta.json, renames the finished save into place and prunes old ones."""
    with open(os.path.join(tmp, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)  # the checkpoint exists only once complete
    if max_to_keep:
        steps = sorted(
            int(n[5:]) for n in os.listdir(directory) if n.startswith("step_") and n[5:].isdigit()
        )
        for old in steps[:-max_to_keep]:
            shutil.rmtree(_step_dir(directory, old), ignore_errors=True)


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "meta.json")) as fh:
        meta = json.load(fh)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unsupported checkpoint format {meta.get('format')!r}")
    return meta


def _check_tables(lowered: Lowered, meta: dict, path: str) -> None:
    for tp in lowered.plan.tables:
        if tp.name not in meta["tables"]:
            raise ValueError(f"checkpoint {path} has no table {tp.name!r}")
        saved, t = meta["tables"][tp.name], lowered.table(tp.name)
        if (saved["vocab_size"], saved["dim"]) != (t.vocab_size, t.dim):
            raise ValueError(
                f"table {tp.name!r}: checkpoint is [{saved['vocab_size']}, "
                f"{saved['dim']}], configured [{t.vocab_size}, {t.dim}]"
            )


def _empty_tables(setup: TrainSetup) -> dict[str, jax.Array]:
    """New zero group buffers, sharded like the state's (never aliasing a live state)."""
    out = {}
    for g in setup.lowered.groups:
        shape = (setup.lowered.num_devices, g.rows_per_device, g.width)
        make = jax.jit(
            lambda s=shape, d=g.dtype: jnp.zeros(s, d), out_shardings=setup.table_sharding
        )
        out[g.name] = make()
    return out


def restore(
    directory: str, setup: TrainSetup, *, step: int | None = None
) -> tuple[TrainState, dict[str, Any]]:
    """Builds a new `TrainState` from a checkpoint, whatever plan, device count or process
    count it was saved with (laid out for `setup`'s plan). Returns `(state, meta)`; meta has
    `step`, `data_position`, `plan` (the plan it was saved with) and `path`. Nothing the
    caller holds is changed, so a failure leaves the live state usable."""
    step = latest_step(directory) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint in {directory}")
    path = _step_dir(directory, step)
    meta = read_meta(path)
    lowered = setup.lowered
    _check_tables(lowered, meta, path)
    ckptr = ocp.StandardCheckpointer()
    dense = ckptr.restore(os.path.join(path, "dense"), setup.dense_template)
    tables = _empty_tables(setup)
    slots = init_slots(setup, tables)
    for tp in lowered.plan.tables:
        arrays = ckptr.restore(os.path.join(path, "tables", tp.name))
        write_table(lowered, tp.name, arrays, tables, slots)
    state = TrainState(
        step=jax.device_put(np.int32(meta["step"]), setup.replicated),
        dense_params=dense["params"],
        dense_opt=dense["opt"],
        tables=tables,
        slots=slots,
        rng=dense["rng"],
    )
    meta["path"] = path
    meta["plan"] = Plan.from_dict(meta["plan"])
    return state, meta


# --- single tables <-> numpy ------------------------------------------------------------


def export_table(setup: TrainSetup, state: TrainState, name: str, path: str) -> None:
    """Writes one table to `path`: `.npy` (the table) or `.npz` (table and slots)."""
    arrays = table_arrays(setup.lowered, name, state.tables, state.slots)
    if path.endswith(".npz"):
        np.savez(
            path, table=arrays["table"], **{f"slot_{k}": v for k, v in arrays["slots"].items()}
        )
    else:
        np.save(path, arrays["table"])


def import_table(setup: TrainSetup, state: TrainState, name: str, path: str) -> TrainState:
    """A new state with one table (e.g. pretrained embeddings) loaded from `.npy`/`.npz`;
    slots found in an `.npz` are loaded too, others keep their values. The given state is
    not changed (its group buffer is copied before the write)."""
    lowered = setup.lowered
    current = table_arrays(lowered, name, state.tables, state.slots)
    if path.endswith(".npz"):
        with np.load(path) as z:
            arrays = {
                "table": z["table"],
                "slots": {k[5:]: z[k] for k in z.files if k.startswith("slot_")},
            }
        arrays["slots"] = {**current["slots"], **arrays["slots"]}
    else:
        arrays = {"table": np.load(path), "slots": current["slots"]}
    group = lowered.group_of(name).name
    tables = {**state.tables, group: jnp.copy(state.tables[group])}
    slots = {**state.slots, group: jax.tree.map(jnp.copy, state.slots[group])}
    write_table(lowered, name, arrays, tables, slots)
    return state.replace(tables=tables, slots=slots)


# --- the fit loop's checkpoint callback ----------------------------------------------


class CheckpointEvery(CallbackBase):
    """Saves a checkpoint every `every` steps and after the last one (asynchronously with
    `async_save`: one save in flight at a time). `last_saved` is the newest complete save."""

    def __init__(
        self,
        directory: str,
        runner: StepRunner,
        every: int,
        last_step: int,
        *,
        async_save: bool = False,
    ):
        self.directory, self.runner, self.every = directory, runner, every
        self.last_step, self.async_save = last_step, async_save
        self.last_saved: str | None = None
        self._pending: PendingSave | None = None

    def on_step_end(self, step, state, result):
        position = step + 1
        if position % self.every and position != self.last_step:
            return
        self._settle()
        setup = self.runner.setup
        if self.async_save:
            self._pending = save_async(self.directory, setup, state, data_position=position)
        else:
            self.last_saved = save(self.directory, setup, state, data_position=position)

    def _settle(self) -> None:
        if self._pending is not None:
            self.last_saved = self._pending.wait()
            self._pending = None

    def on_end(self, state):
        self._settle()
