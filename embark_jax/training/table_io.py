"""Tables in logical form <-> the stacked group buffers of a plan.

A table's logical form is its `[V, d]` rows in id order (and its optimizer slots the same
way), independent of any plan: checkpoints and single-table export use it. Reading gathers
only the blocks a table's shards live in; writing updates one device's block in place, so no
host ever builds a whole group buffer. Where each id's row lives is asked of the lowered
plan's `ShardLayout` (`Lowered.layout`, `Lowered.shard_ids`).

Everything written is checked first (`check_arrays`: shape, finite values within the table
dtype's range, the configured optimizer's slot names and shapes, non-negative
accumulators), for checkpoint restores and single-table imports (`import_table`) alike.
"""

from __future__ import annotations

import functools
import zipfile
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from embark_jax.core.names import name_mismatch
from embark_jax.core.plan import Cluster
from embark_jax.sharding.lowering import Lowered
from embark_jax.training.state import TrainSetup, TrainState

__all__ = [
    "check_arrays",
    "expected_slots",
    "export_table",
    "fingerprint",
    "import_table",
    "table_arrays",
    "write_table",
]

# slots that are sums of squares: negative values are impossible (and give NaN updates)
_NON_NEGATIVE = ("accumulator", "v")


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


def expected_slots(lowered: Lowered, name: str) -> dict[str, tuple[int, ...]]:
    """Slot name -> logical shape for table `name` under its configured optimizer (a
    per-table counter such as Adam's `count` is `()`)."""
    group = lowered.group_of(name)
    t = lowered.table(name)
    opt = group.optimizer
    if opt is None:
        return {}
    shapes = opt.slot_shapes(t.vocab_size, t.dim)
    fields = jax.eval_shape(opt.init, jax.ShapeDtypeStruct((1, 1), jnp.float32))._fields
    return {k: tuple(shapes.get(k, ())) for k in fields}


def _is_float(dtype: np.dtype) -> bool:
    """numpy floats and the ml_dtypes floats JAX uses (bfloat16 is not a numpy subtype)."""
    return np.issubdtype(dtype, np.floating) or jnp.issubdtype(dtype, jnp.floating)


def _check_values(name: str, what: str, x: np.ndarray, dtype: np.dtype) -> None:
    numeric = _is_float(x.dtype) or np.issubdtype(x.dtype, np.number)
    if not numeric:
        raise ValueError(f"table {name!r}: {what} has non-numeric dtype {x.dtype}")
    if _is_float(x.dtype) and not np.all(np.isfinite(x.astype(np.float64))):
        raise ValueError(f"table {name!r}: {what} holds NaN or inf")
    if _is_float(dtype) and x.size:
        limit = float(jnp.finfo(dtype).max)
        if float(np.max(np.abs(x.astype(np.float64)))) > limit:
            raise ValueError(f"table {name!r}: {what} has values beyond the {dtype} range")


def check_arrays(lowered: Lowered, name: str, arrays: dict[str, Any], *, partial=False) -> None:
    """Checks a table (and its slots) in logical form before it is written: shape, finite
    values that fit the table's dtype, known slot names with the configured optimizer's
    shapes, non-negative accumulators. `partial`: slots may be missing (an import keeps
    the others). One-line `ValueError` naming the table, the slot and the problem."""
    t = lowered.table(name)
    dtype = np.dtype(jnp.dtype(lowered.group_of(name).dtype))
    table = np.asarray(arrays["table"])
    if table.shape != (t.vocab_size, t.dim):
        raise ValueError(
            f"table {name!r}: checkpoint shape {table.shape} != configured {(t.vocab_size, t.dim)}"
        )
    _check_values(name, "table", table, dtype)
    want = expected_slots(lowered, name)
    got = arrays.get("slots", {})
    unknown, missing = name_mismatch(got, want)
    if unknown:
        opt = type(lowered.group_of(name).optimizer).__name__
        raise ValueError(f"table {name!r}: unknown slots {unknown} for optimizer {opt}")
    if missing and not partial:
        raise ValueError(
            f"table {name!r}: checkpoint has no optimizer slots {missing} "
            "(saved with another optimizer?)"
        )
    for k, v in got.items():
        v = np.asarray(v)
        if v.shape != want[k]:
            raise ValueError(f"table {name!r}: slot {k!r} has shape {v.shape}, expected {want[k]}")
        _check_values(name, f"slot {k!r}", v, np.dtype(np.float32))
        if (k in _NON_NEGATIVE or v.ndim == 0) and np.any(v < 0):
            raise ValueError(f"table {name!r}: slot {k!r} has negative values")


def fingerprint(arrays: dict[str, Any]) -> str:
    """A CRC-32 of a table's and its slots' bytes (shape and dtype included), recorded per
    table in meta.json: a table directory copied from another checkpoint does not match."""
    crc = 0
    items = [("table", arrays["table"]), *sorted(arrays.get("slots", {}).items())]
    for k, v in items:
        v = np.ascontiguousarray(v)
        crc = zlib.crc32(f"{k}:{v.shape}:{v.dtype};".encode(), crc)
        crc = zlib.crc32(v.view(np.uint8).reshape(-1) if v.size else b"", crc)
    return f"{crc:08x}"


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


def _read_error(name: str, path: str, e: BaseException) -> ValueError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    if "Object arrays cannot be loaded" in first:
        first = "it holds Python objects (dtype object), not numbers"
    return ValueError(f"table {name!r}: cannot read {path}: {first}")


def _load(path: str, name: str) -> dict[str, Any]:
    """`{"table", "slots"}` from a `.npy` (the table) or `.npz` (`table`, `slot_<name>`),
    or a one-line `ValueError` naming the table and the file: a missing, truncated or
    non-NumPy file, an array of Python objects, an unknown array name."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(6)
    except OSError as e:
        raise ValueError(f"table {name!r}: cannot read {path}: {e.strerror or e}") from None
    npz = path.endswith(".npz")
    if npz and head[:2] != b"PK":
        raise ValueError(f"table {name!r}: {path} is not an .npz archive (as np.savez writes)")
    if not npz and head != b"\x93NUMPY":
        raise ValueError(f"table {name!r}: {path} is not a .npy file (as np.save writes)")
    try:
        if not npz:
            return {"table": np.load(path), "slots": {}}
        with np.load(path) as z:
            if "table" not in z.files:
                raise ValueError(f"table {name!r}: {path} has no array 'table'")
            other = sorted(k for k in z.files if k != "table" and not k.startswith("slot_"))
            if other:
                raise ValueError(f"table {name!r}: {path} has unknown arrays {other}")
            return {
                "table": z["table"],
                "slots": {k[5:]: z[k] for k in z.files if k.startswith("slot_")},
            }
    except ValueError as e:
        if str(e).startswith(f"table {name!r}: "):
            raise
        raise _read_error(name, path, e) from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise _read_error(name, path, e) from None


def _check_import_dtypes(lowered: Lowered, name: str, arrays: dict[str, Any], path: str) -> None:
    """A table and its float slots must be floats: an integer, boolean or complex array is
    refused rather than cast (a restore converts no dtype either); a float of another
    precision is rounded to the table's dtype, its values checked to fit (`check_arrays`).
    An integer slot (Adam's `count`) must hold integers."""
    want = np.dtype(jnp.dtype(lowered.group_of(name).dtype))
    opt = lowered.group_of(name).optimizer
    kinds = {}
    if opt is not None:
        init = jax.eval_shape(opt.init, jax.ShapeDtypeStruct((1, 1), jnp.float32))
        kinds = {k: np.dtype(v.dtype) for k, v in zip(init._fields, init, strict=True)}
    items = [("table", arrays["table"], want)]
    items += [(f"slot {k!r}", v, kinds.get(k)) for k, v in sorted(arrays["slots"].items())]
    for what, x, expected in items:
        dt = np.asarray(x).dtype
        if not (np.issubdtype(dt, np.number) or dt == np.bool_ or _is_float(dt)):
            continue  # text and the like: check_arrays names them non-numeric
        if expected is not None and np.issubdtype(expected, np.integer):
            if np.issubdtype(dt, np.integer):
                continue
            raise ValueError(f"table {name!r}: {what} in {path} is {dt}, not integers")
        if _is_float(dt):
            continue
        raise ValueError(
            f"table {name!r}: {what} in {path} is {dt}, not floats; the table is {want} "
            "(not converted: cast it to a float type first)"
        )


def import_table(setup: TrainSetup, state: TrainState, name: str, path: str) -> TrainState:
    """A new state with one table (e.g. pretrained embeddings) loaded from `.npy`/`.npz`;
    slots found in an `.npz` are loaded too, others keep their values. Checked first, each
    problem a one-line `ValueError` naming the table: a table the model does not have, a
    file that cannot be read as NumPy data, integer or boolean arrays (floats of another
    precision are rounded to the table's dtype), then the values (`check_arrays`: shape,
    finite, in the table dtype's range, known slots of the right shape, non-negative
    accumulators). The given state is not changed."""
    lowered = setup.lowered
    known = [tp.name for tp in lowered.plan.tables]
    if name not in known:
        raise ValueError(f"import_table: unknown table {name!r}; the model's tables: {known}")
    arrays = _load(str(path), name)
    _check_import_dtypes(lowered, name, arrays, str(path))
    check_arrays(lowered, name, arrays, partial=True)
    current = table_arrays(lowered, name, state.tables, state.slots)
    arrays["slots"] = {**current["slots"], **arrays["slots"]}
    group = lowered.group_of(name).name
    tables = {**state.tables, group: jnp.copy(state.tables[group])}
    slots = {**state.slots, group: jax.tree.map(jnp.copy, state.slots[group])}
    write_table(lowered, name, arrays, tables, slots)
    return state.replace(tables=tables, slots=slots)
