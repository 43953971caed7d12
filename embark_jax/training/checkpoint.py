"""Checkpoints with Orbax that reshard across plans, device counts and processes.

A checkpoint stores every table and its optimizer slots in *logical* form (`[V, d]` rows in
id order), so it does not depend on the plan that wrote it, next to the dense parameters and
optax state, the step, the data position and the plan (for reference):

    <dir>/step_00000100/meta.json          format, step, data position, plan, table specs
    <dir>/step_00000100/dense/             Orbax: dense params + optax state
    <dir>/step_00000100/tables/<name>/     Orbax: {"table": [V, d], "slots": {...}}

Saving and restoring stream table by table: at most one table (and its slots) is on the host
at a time; restoring writes each table's rows straight into the new plan's device buffers.
Saves are atomic (also re-saving a step), `latest_step` is the last one committed and
pruning keeps the latest commits: see `embark_jax.training.checkpoint_dir`. A save refuses
a state holding NaN or inf. Each table's meta.json entry records its dtype, optimizer, step
and a fingerprint (CRC-32) of its data, so a restore into another optimizer or dtype, or
from a table directory copied from another checkpoint, fails naming the table; the dense
part (parameters, optax state, RNG key) has a fingerprint of its own (`dense_fingerprint`).
`save_async` writes in a background thread from an on-device snapshot.

Functions take a `TrainSetup` and a `TrainState` and never change the state they are given:
`restore` and `import_table` build and return a new one (the caller swaps it in when it is
complete), so a failed restore leaves the live state usable.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from embark_jax.core.plan import Plan
from embark_jax.training.checkpoint_dir import (
    FORMAT,
    MAX_POSITION,
    MAX_STEP,
    check_writable,
    commit,
    field,
    is_count,
    latest_step,
    not_a_directory,
    read_meta,
    resolve,
    step_dir,
    table_dirname,
)
from embark_jax.training.dynamic_io import LogicalDynamicTable, export_logical, import_logical
from embark_jax.training.loop import CallbackBase
from embark_jax.training.runner import StepRunner
from embark_jax.training.state import TrainSetup, TrainState, init_slots, init_staging
from embark_jax.training.step import all_finite
from embark_jax.training.table_io import (
    check_arrays,
    export_table,
    fingerprint,
    import_table,
    table_arrays,
    write_table,
)

__all__ = [
    "FORMAT",
    "CheckpointEvery",
    "PendingSave",
    "check_writable",
    "export_table",
    "import_table",
    "latest_step",
    "restore",
    "save",
    "save_async",
]

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
    directory: str, setup: TrainSetup, state: TrainState, *, step: int | None = None, **options
) -> PendingSave:
    """Like `save` (the same keyword options: `step`, `data_position`, `max_to_keep`), but
    writes in a background thread while training goes on.

    The state is first copied on the devices (in-place training donates its buffers at the
    next step), which costs one extra copy of the tables and slots in device memory until the
    save is done. Single-process runs only (the multi-process save synchronises processes).
    """
    if jax.process_count() > 1:
        raise ValueError("asynchronous saves are single-process only; use save()")
    directory = os.path.abspath(directory)  # as of the call, whatever the cwd is later
    step = int(state.step) if step is None else step
    snapshot = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    box: dict = {}

    def run():
        try:
            save(directory, setup, snapshot, step=step, **options)
        except BaseException as e:  # surfaced by wait()
            box["error"] = e

    thread = threading.Thread(target=run, name=f"embark-ckpt-{step}", daemon=True)
    thread.start()
    return PendingSave(step_dir(directory, step), thread, box)


def _dense_tree(state: TrainState) -> dict[str, Any]:
    return {"params": state.dense_params, "opt": state.dense_opt, "rng": state.rng}


def _dense_spec(tree: Any) -> dict[str, list]:
    """Path -> [shape, dtype] of every dense leaf (recorded in meta.json, checked first)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(k): [list(v.shape), str(v.dtype)] for k, v in leaves}


def dense_fingerprint(tree: Any) -> str:
    """A CRC-32 of the dense tree's bytes, leaf by leaf with its path, shape and dtype,
    recorded in meta.json: a dense directory copied from another checkpoint (or damaged)
    does not match. The leaves are replicated, so every process computes the same."""
    crc = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        v = np.ascontiguousarray(np.asarray(leaf))
        crc = zlib.crc32(f"{jax.tree_util.keystr(path)}:{v.shape}:{v.dtype};".encode(), crc)
        crc = zlib.crc32(v.view(np.uint8).reshape(-1) if v.size else b"", crc)
    return f"{crc:08x}"


def _optimizer_name(setup: TrainSetup, name: str) -> str | None:
    opt = setup.lowered.group_of(name).optimizer
    return type(opt).__name__ if opt else None


def _table_meta(setup: TrainSetup, name: str, arrays: dict[str, Any], step: int) -> dict:
    t = setup.lowered.table(name)
    return {
        "vocab_size": t.vocab_size,
        "dim": t.dim,
        "dtype": str(np.dtype(arrays["table"].dtype)),
        "optimizer": _optimizer_name(setup, name),
        "slots": sorted(arrays["slots"]),
        "dir": table_dirname(name),
        "step": step,
        "fingerprint": fingerprint(arrays),
    }


def _count(name: str, value, limit: int) -> int:
    """`value` as an int in [0, limit] (numpy integers too), else a one-line ValueError."""
    if is_count(value, limit):
        return int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"checkpoint save: {name} must be an integer, got {value!r}")
    raise ValueError(f"checkpoint save: {name} must be in [0, {limit}], got {int(value)}")


def _write(setup: TrainSetup, state: TrainState, tmp: str, step: int) -> dict[str, dict]:
    """Writes the dense tree and every table under `tmp`; returns the tables' metadata."""
    lowered = setup.lowered
    tables_meta = {}
    with ocp.StandardCheckpointer() as ckptr:  # closed on every path, a failed write too
        ckptr.save(os.path.join(tmp, "dense"), _dense_tree(state))
        for tp in lowered.plan.tables:
            arrays = table_arrays(lowered, tp.name, state.tables, state.slots)
            ckptr.save(os.path.join(tmp, "tables", table_dirname(tp.name)), arrays)
            ckptr.wait_until_finished()  # one table on the host at a time
            tables_meta[tp.name] = _table_meta(setup, tp.name, arrays, step)
        for name, shards in state.dynamic.items():
            tree = export_logical(shards, setup.dynamic.config.table(name)).as_tree()
            ckptr.save(os.path.join(tmp, "dynamic", table_dirname(name)), tree)
            ckptr.wait_until_finished()
            tables_meta[name] = _dynamic_meta(setup.dynamic.config.table(name), tree, step)
    return tables_meta


def _dynamic_fingerprint(tree: dict[str, Any]) -> str:
    return fingerprint(
        {"table": tree["values"], "slots": {k: v for k, v in tree.items() if k != "values"}}
    )


def _dynamic_meta(config, tree: dict[str, Any], step: int) -> dict:
    """A dynamic table's entry in meta.json (its logical form: `training.dynamic_io`)."""
    return {
        "dynamic": True,
        "dim": config.dim,
        "dtype": str(np.dtype(config.dtype)),
        "rows": int(tree["ids"].shape[0]),
        "slots": sorted(k[5:] for k in tree if k.startswith("slot_")),
        "dir": table_dirname(config.name),
        "step": step,
        "fingerprint": _dynamic_fingerprint(tree),
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
    """Saves the whole training state; returns the checkpoint directory. Refuses (a
    `FloatingPointError`, nothing written) a state holding NaN or inf. Atomic, pruning and
    leftovers: see `embark_jax.training.checkpoint_dir`. A relative `directory` is taken
    from the current directory (Orbax itself takes only absolute paths)."""
    directory = os.path.abspath(directory)
    if not_a_directory(directory):
        raise NotADirectoryError(f"checkpoint directory {directory!r} is not a directory")
    step = _count("step", int(state.step) if step is None else step, MAX_STEP)
    data_position = step if data_position is None else data_position
    data_position = _count("data_position", data_position, MAX_POSITION)
    dynamic_values = [s.values for s in state.dynamic.values()]
    if not bool(all_finite(_dense_tree(state), state.tables, state.slots, dynamic_values)):
        raise FloatingPointError(f"refusing to save step {step}: the state holds NaN or inf")
    final = step_dir(directory, step)
    tag = multihost_utils.broadcast_one_to_all(np.int64(uuid.uuid4().int % (1 << 62)))
    tmp = f"{final}.tmp-{int(tag):x}"
    lowered = setup.lowered
    try:
        # Created here first, so that a directory that cannot be made fails before Orbax
        # starts its threads (which then waited ~5 min at exit for a directory that never came).
        os.makedirs(tmp, exist_ok=True)
        tables_meta = _write(setup, state, tmp, step)
        if jax.process_index() == 0:
            meta = {
                "format": FORMAT,
                "step": step,
                "data_position": data_position,
                "plan": lowered.plan.to_dict(),
                "dense": _dense_spec(_dense_tree(state)),
                "dense_fingerprint": dense_fingerprint(_dense_tree(state)),
                "tables": tables_meta,
            }
            commit(directory, tmp, final, meta, max_to_keep)
    except Exception:
        # A failed save leaves nothing behind. A process killed (or interrupted) leaves its
        # temporary directory, as does any failure with several processes, which may still
        # be writing there: the next save removes such leftovers (checkpoint_dir).
        if jax.process_count() == 1:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    multihost_utils.sync_global_devices(f"embark-ckpt-save-{step}")
    return final


def _check_tables(setup: TrainSetup, meta: dict, path: str) -> None:
    """Every mismatch between the checkpoint's tables and the model's, before any read."""
    saved_tables = field(meta, "tables", f"{path}/meta.json")
    saved_tables = {k: v for k, v in saved_tables.items() if not v.get("dynamic")}  # own check
    lowered = setup.lowered
    configured = [tp.name for tp in lowered.plan.tables]
    extra = sorted(set(saved_tables) - set(configured))
    if extra:
        raise ValueError(f"checkpoint {path} has tables {extra} that the model does not configure")
    for name in configured:
        if name not in saved_tables:
            raise ValueError(f"checkpoint {path} has no table {name!r}")
        saved, t = saved_tables[name], lowered.table(name)
        where = f"{path}/meta.json table {name!r}"
        shape = [field(saved, "vocab_size", where), field(saved, "dim", where)]
        if shape != [t.vocab_size, t.dim]:
            raise ValueError(
                f"table {name!r}: checkpoint is {shape}, configured [{t.vocab_size}, {t.dim}]"
            )
        want = str(np.dtype(jnp.dtype(lowered.group_of(name).dtype)))
        if field(saved, "dtype", where) != want:
            raise ValueError(
                f"table {name!r}: checkpoint dtype {saved['dtype']}, configured {want} "
                "(not converted; restore into a model with the same table dtype)"
            )
        table_step = saved.get("step", meta["step"])  # absent in no checkpoint we wrote
        if type(table_step) is not int or table_step != meta["step"]:  # not True, not 1.0
            raise ValueError(
                f"table {name!r}: {where} records step {table_step!r}, the checkpoint "
                f"{meta['step']} (copied from another checkpoint?)"
            )
        opt = _optimizer_name(setup, name)
        if field(saved, "optimizer", where) != opt:
            raise ValueError(
                f"table {name!r}: checkpoint optimizer {saved['optimizer']}, configured {opt} "
                "(saved with another optimizer; slots are not converted)"
            )


def _check_dense(setup: TrainSetup, meta: dict, path: str) -> None:
    saved = meta.get("dense")
    if saved is None:  # written before dense specs were recorded
        return
    want = _dense_spec(setup.dense_template)
    for key in sorted(set(saved) | set(want)):
        if saved.get(key) != want.get(key):
            raise ValueError(
                f"checkpoint {path}: dense parameter {key} is {saved.get(key)} there, "
                f"{want.get(key)} in the model (another dense model or table set?)"
            )


def _read(what: str, fn, directory: str):
    """`fn()`, with any failure re-raised as one line naming what was being read. A
    directory we may not read says so (Orbax would report its metadata file missing)."""
    if os.path.isdir(directory) and not os.access(directory, os.R_OK | os.X_OK):
        raise ValueError(f"cannot read {what}: permission denied on {directory}")
    try:
        return fn()
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"cannot read {what}: {type(e).__name__}: {first}") from e


def _table_dir(path: str, name: str, saved: dict) -> str:
    d = saved.get("dir", name)  # checkpoints before encoded names used the name itself
    if not isinstance(d, str):
        raise ValueError(f"table {name!r}: its dir in {path}/meta.json must be a string, got {d!r}")
    if d != table_dirname(name) and (d in ("", ".", "..") or "/" in d or os.sep in d):
        raise ValueError(f"table {name!r}: unsafe directory {d!r} in {path}/meta.json")
    return os.path.join(path, "tables", d)


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


def _read_all(ckptr, setup: TrainSetup, meta: dict, path: str) -> tuple[Any, dict, dict]:
    """The dense tree and new table and slot buffers read from checkpoint `path`."""
    lowered = setup.lowered
    dense_dir = os.path.join(path, "dense")
    dense = _read(dense_dir, lambda: ckptr.restore(dense_dir, setup.dense_template), dense_dir)
    saved = meta.get("dense_fingerprint")  # absent in checkpoints written before it
    if saved is not None and dense_fingerprint(dense) != saved:
        raise ValueError(
            f"checkpoint {path}: {dense_dir} does not match the fingerprint recorded for step "
            f"{meta['step']} (dense parameters copied from another checkpoint, or damaged)"
        )
    tables = _empty_tables(setup)
    slots = init_slots(setup, tables)
    for tp in lowered.plan.tables:
        saved = meta["tables"][tp.name]
        d = _table_dir(path, tp.name, saved)
        arrays = _read(f"table {tp.name!r} ({d})", lambda d=d: ckptr.restore(d), d)
        if "fingerprint" in saved and fingerprint(arrays) != saved["fingerprint"]:
            raise ValueError(
                f"table {tp.name!r}: {d} does not match the fingerprint recorded for step "
                f"{meta['step']} (copied from another checkpoint, or damaged)"
            )
        check_arrays(lowered, tp.name, arrays)
        write_table(lowered, tp.name, arrays, tables, slots)
    return dense, tables, slots


def _check_dynamic(setup: TrainSetup, meta: dict, path: str) -> tuple[dict, dict]:
    """The checkpoint's and the setup's dynamic tables, by name; the same names, or a
    `ValueError` before anything is read."""
    saved = {k: v for k, v in meta["tables"].items() if v.get("dynamic")}
    want = {t.name: t for t in (setup.dynamic.config.tables if setup.dynamic else ())}
    if set(saved) != set(want):
        raise ValueError(
            f"checkpoint {path}: dynamic tables {sorted(saved)}, the setup has {sorted(want)}"
        )
    for name, cfg in want.items():  # before the dense check: the dense inputs follow dims
        m = saved[name]
        if (m["dim"], m["dtype"]) != (cfg.dim, str(np.dtype(cfg.dtype))):
            raise ValueError(
                f"dynamic table {name!r}: checkpoint has dim {m['dim']} {m['dtype']}, the "
                f"setup {cfg.dim} {np.dtype(cfg.dtype)}"
            )
    return saved, want


def _read_dynamic(ckptr, setup: TrainSetup, meta: dict, path: str) -> dict[str, Any]:
    """The dynamic tables of checkpoint `path` placed onto `setup`'s shards (rehashed: any
    shard count); a table missing on either side, of another dim or dtype, copied from
    another checkpoint or not fitting the new shards is a `ValueError` naming it."""
    saved, want = _check_dynamic(setup, meta, path)
    dyn = setup.dynamic
    out = {}
    for name, cfg in want.items():
        m = saved[name]
        d = os.path.join(path, "dynamic", m["dir"])
        tree = _read(f"dynamic table {name!r} ({d})", lambda d=d: ckptr.restore(d), d)
        tree = {k: np.asarray(v) for k, v in tree.items()}
        if _dynamic_fingerprint(tree) != m["fingerprint"]:
            raise ValueError(
                f"dynamic table {name!r}: {d} does not match the fingerprint recorded for step "
                f"{meta['step']} (copied from another checkpoint, or damaged)"
            )
        logical = LogicalDynamicTable.from_tree(tree)
        if dyn.config.is_replicated(name):  # one whole table, copied to every device
            one = import_logical(logical, cfg, 1, dyn.optimizers[name])
            host = jax.tree.map(lambda x: np.broadcast_to(x, (dyn.num_shards, *x.shape[1:])), one)
        else:
            host = import_logical(logical, cfg, dyn.num_shards, dyn.optimizers[name])
        out[name] = dyn.place(host)
    return out


def restore(
    directory: str, setup: TrainSetup, *, step: int | None = None
) -> tuple[TrainState, dict[str, Any]]:
    """Builds a new `TrainState` from a checkpoint, whatever plan, device count or process
    count it was saved with (laid out for `setup`'s plan). Returns `(state, meta)`; meta has
    `step`, `data_position`, `plan` (the plan it was saved with) and `path`. Nothing the
    caller holds is changed, so a failure leaves the live state usable. Every mismatch
    (tables, shapes, dtypes, optimizers, dense parameters, a table directory that is not
    the one this checkpoint recorded) is a `ValueError` naming the table or parameter."""
    directory = os.path.abspath(directory)  # Orbax takes only absolute paths
    step = latest_step(directory) if step is None else step
    path = None if step is None else resolve(directory, step)
    if path is None:
        what = "no complete checkpoint" if step is None else f"no complete checkpoint {step}"
        raise FileNotFoundError(f"{what} in {directory}")
    meta = read_meta(path)
    if meta["step"] != step:
        raise ValueError(f"checkpoint {path}: its meta.json says step {meta['step']}, not {step}")
    try:
        plan = Plan.from_dict(meta["plan"])
    except ValueError as e:  # PlanError included
        raise ValueError(f"checkpoint metadata {path}/meta.json: plan: {e}") from None
    _check_tables(setup, meta, path)
    _check_dynamic(setup, meta, path)
    _check_dense(setup, meta, path)
    with ocp.StandardCheckpointer() as ckptr:  # closed on every path, a failed read too
        dense, tables, slots = _read_all(ckptr, setup, meta, path)
        dynamic = _read_dynamic(ckptr, setup, meta, path)
    state = TrainState(
        step=jax.device_put(np.int32(meta["step"]), setup.replicated),
        dense_params=dense["params"],
        dense_opt=dense["opt"],
        tables=tables,
        slots=slots,
        rng=dense["rng"],
        dynamic=dynamic,
        staging=init_staging(setup, tables, slots),
    )
    meta["path"] = path
    meta["plan"] = plan
    meta.setdefault("data_position", meta["step"])
    return state, meta


# --- the fit loop's checkpoint callback ----------------------------------------------


class CheckpointEvery(CallbackBase):
    """Saves a checkpoint every `every` steps (0: only after the last one) and after the last
    one (asynchronously with
    `async_save`: one save in flight at a time). `last_saved` is the newest complete save.
    Construction checks that `directory` is writable (`PermissionError` otherwise)."""

    def __init__(
        self,
        directory: str,
        runner: StepRunner,
        every: int,
        last_step: int,
        *,
        async_save: bool = False,
    ):
        check_writable(directory)  # fail before training, not at the first save
        self.directory, self.runner, self.every = directory, runner, every
        self.last_step, self.async_save = last_step, async_save
        self.last_saved: str | None = None
        self._pending: PendingSave | None = None

    def on_step_end(self, step, state, result):
        position = step + 1
        periodic = self.every > 0 and position % self.every == 0
        if not periodic and position != self.last_step:
            return
        self.runner.sync()  # a refused step raises here, before anything is written
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

    def wait(self) -> None:
        """Waits for an asynchronous save in flight (re-raising its error), e.g. when
        training stops early; `last_saved` is then the newest complete save."""
        self._settle()

    def on_end(self, state):
        self._settle()
