"""The sharding plan: where every shard of every table lives, as plain validated data.

A table is split into `column_shards` (c) column slices and `row_shards` (r) row shards;
`devices[k][j]` is the global device holding column slice k, row shard j. Row shard j owns
the ids with `id % r == j` (local row `id // r`); column slice k owns columns
[k*d/c, (k+1)*d/c). Device g lives on node `g // devices_per_node`. A `dp` table is
replicated: `devices == [[0, 1, ..., G-1]]` with r = c = 1.

JSON format (`Plan.to_json`; read back with `Plan.from_json(text)` or `Plan.from_file(path)`):

    {"format": "embark-plan/1",
     "topology": {"num_nodes": 1, "devices_per_node": 8},
     "batch_size": 4096,
     "tables": [{"name": "t0", "cluster": "rb", "row_shards": 2, "column_shards": 2,
                 "devices": [[0, 1], [2, 3]]}]}

Optional per table: `"capacity_factor"` (routing buffer size as a multiple of the expected
per-destination load, see `embark_jax.sharding.capacity`) and `"unique_capacity"` (UB dedup slots).

Reading is strict: every count and device is a JSON integer (2.7, 16.0 and `true` are refused,
never truncated), `capacity_factor` a finite number > 0, and an unknown key (a misspelt field)
is an error; each `PlanError` names the table and the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from embark_jax.core.choice import Choice
from embark_jax.core.names import name_mismatch
from embark_jax.core.specs import Combiner, EmbeddingConfig

__all__ = ["FORMAT", "MAX_BATCH_SIZE", "Cluster", "Plan", "PlanError", "TablePlan", "Topology"]

FORMAT = "embark-plan/1"
MAX_BATCH_SIZE = 2**31 - 1  # samples of a global batch: int32 ids and bags index it


class PlanError(ValueError):
    """An invalid plan; the message names the table and the problem."""


class Cluster(Choice):
    """How a table's lookups communicate (docs/design.md §3)."""

    DP = "dp"  # replicated, local lookups, gradients gathered
    RB = "rb"  # reduction-based: owners pool, partial vectors are summed
    UB = "ub"  # unique-based: unique ids routed, one vector per unique id returned

    @classmethod
    def error_type(cls) -> type[Exception]:
        return PlanError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    num_nodes: int = 1
    devices_per_node: int = 8

    def __post_init__(self) -> None:
        for field in ("num_nodes", "devices_per_node"):
            object.__setattr__(self, field, _as_int(getattr(self, field), f"topology {field}"))
        if self.num_nodes < 1 or self.devices_per_node < 1:
            raise PlanError(f"topology needs >= 1 node and device per node, got {self}")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node


@dataclasses.dataclass(frozen=True, kw_only=True)
class TablePlan:
    """Placement of one table. `devices[k][j]`: device of column slice k, row shard j."""

    name: str
    cluster: Cluster | str
    row_shards: int
    column_shards: int
    devices: tuple[tuple[int, ...], ...]
    capacity_factor: float | None = None
    unique_capacity: int | None = None

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"table name must be a non-empty string, got {self.name!r}")
        try:
            object.__setattr__(self, "cluster", Cluster.parse(self.cluster))
        except PlanError as e:
            raise PlanError(f"{where}: {e}") from None
        for field in ("row_shards", "column_shards"):
            object.__setattr__(self, field, _as_int(getattr(self, field), f"{where}: {field}"))
        object.__setattr__(self, "devices", _as_devices(self.devices, where))
        if self.capacity_factor is not None:
            c = self.capacity_factor
            if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c):
                raise PlanError(f"{where}: capacity_factor must be a finite number, got {c!r}")
            object.__setattr__(self, "capacity_factor", float(c))
        if self.unique_capacity is not None:
            object.__setattr__(
                self, "unique_capacity", _as_int(self.unique_capacity, f"{where}: unique_capacity")
            )

    def shard_devices(self) -> list[tuple[int, int, int]]:
        """`(k, j, device)` of every shard (dp: one replica per device as j)."""
        return [(k, j, d) for k, col in enumerate(self.devices) for j, d in enumerate(col)]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "cluster": self.cluster.value,
            "row_shards": self.row_shards,
            "column_shards": self.column_shards,
            "devices": [list(c) for c in self.devices],
        }
        if self.capacity_factor is not None:
            out["capacity_factor"] = self.capacity_factor
        if self.unique_capacity is not None:
            out["unique_capacity"] = self.unique_capacity
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    topology: Topology
    batch_size: int
    tables: tuple[TablePlan, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "batch_size", _as_int(self.batch_size, "batch_size"))
        self._validate_structure()

    # --- validation ----------------------------------------------------------------------

    def _validate_structure(self) -> None:
        g = self.topology.num_devices
        if self.batch_size < 1 or self.batch_size % g:
            raise PlanError(
                f"batch_size {self.batch_size} must be a positive multiple of the {g} devices"
            )
        if self.batch_size > MAX_BATCH_SIZE:
            raise PlanError(
                f"batch_size {self.batch_size} is above {MAX_BATCH_SIZE} (int32 ids and bags "
                f"index a batch)"
            )
        seen: set[str] = set()
        for t in self.tables:
            if t.name in seen:
                raise PlanError(f"table {t.name!r} is planned twice")
            seen.add(t.name)
            _validate_table(t, g)

    def validate(self, config: EmbeddingConfig) -> None:
        """Checks the plan against the tables: every table planned exactly once, column
        slices divide the dim, sequence (`none`) features not on RB tables."""
        by_name = config.table_by_name
        unknown, missing = name_mismatch((t.name for t in self.tables), by_name)
        if missing:
            raise PlanError(f"tables {_few(missing)} are not in the plan")
        if unknown:
            raise PlanError(f"plan places unknown tables {_few(unknown)}")
        for t in self.tables:
            dim = by_name[t.name].dim
            if dim % t.column_shards:
                raise PlanError(
                    f"table {t.name!r}: column_shards {t.column_shards} does not divide dim {dim}"
                )
        for f in config.features:
            tp = self.table(f.table)
            if f.combiner is Combiner.NONE and tp.cluster is Cluster.RB:
                raise PlanError(
                    f"feature {f.name!r} has combiner 'none' (no pooling); its table "
                    f"{f.table!r} must be in a dp or ub cluster, not rb"
                )

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.name == name:
                return t
        raise PlanError(f"table {name!r} is not in the plan")

    # --- JSON ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "topology": {
                "num_nodes": self.topology.num_nodes,
                "devices_per_node": self.topology.devices_per_node,
            },
            "batch_size": self.batch_size,
            "tables": [t.to_dict() for t in self.tables],
        }

    def to_json(self, path: str | None = None, indent: int | None = 1) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """A plan from its JSON form, strictly checked (see the module docstring)."""
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise PlanError(f"unsupported plan format {data.get('format')!r}; expected {FORMAT!r}")
        _check_keys(data, _PLAN_KEYS, _PLAN_KEYS, "plan")
        topo = data["topology"]
        if not isinstance(topo, dict):
            raise PlanError(f"plan topology must be an object, got {topo!r}")
        _check_keys(topo, _TOPOLOGY_KEYS, _TOPOLOGY_KEYS, "plan topology")
        tables = data["tables"]
        if not isinstance(tables, list):
            raise PlanError(f"plan tables must be a list, got {type(tables).__name__}")
        parsed = []
        for i, t in enumerate(tables):
            if not isinstance(t, dict):
                raise PlanError(f"plan table #{i} must be an object, got {t!r}")
            where = f"table {t.get('name', f'#{i}')!r}"
            _check_keys(t, _TABLE_KEYS, _TABLE_REQUIRED, where)
            parsed.append(TablePlan(**t))
        return cls(topology=Topology(**topo), batch_size=data["batch_size"], tables=tuple(parsed))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan from JSON text (never a path: see `from_file`)."""
        if not isinstance(text, str | bytes):
            raise TypeError(f"Plan.from_json takes JSON text, got {type(text).__name__}")
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | Any) -> Plan:
        """A plan from a JSON file written by `to_json(path)` or `plan --out`."""
        try:
            with open(path) as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or str(e)
            raise PlanError(f"cannot read plan file {str(path)!r}: {reason}") from None
        try:
            return cls.from_json(text)
        except PlanError as e:
            raise PlanError(f"plan file {str(path)!r}: {e}") from None

    # --- mesh ----------------------------------------------------------------------------

    @property
    def axis_names(self) -> tuple[str, ...]:
        return ("device",) if self.topology.num_nodes == 1 else ("node", "local")

    def make_mesh(self, devices: Sequence[Any] | None = None) -> Any:
        """A 1-D `("device",)` mesh (one node) or 2-D `("node", "local")` mesh over the
        plan's devices, in global device order (device g = node * L + local)."""
        import jax  # the plan itself is plain data; only the mesh needs JAX

        g = self.topology.num_devices
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < g:
            raise PlanError(
                f"plan needs {g} devices, only {len(devices)} available; on a machine without "
                f"{g} accelerators, get {g} fake CPU devices with "
                f'jax.config.update("jax_num_cpu_devices", {g}) before any JAX operation '
                f"(or XLA_FLAGS=--xla_force_host_platform_device_count={g})"
            )
        arr = np.array(devices[:g], dtype=object)
        shape = (
            (g,)
            if self.topology.num_nodes == 1
            else (self.topology.num_nodes, self.topology.devices_per_node)
        )
        auto = (jax.sharding.AxisType.Auto,) * len(shape)
        return jax.sharding.Mesh(arr.reshape(shape), self.axis_names, axis_types=auto)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (`json` keeps the last one
    silently, so `"batch_size": 16, "batch_size": 24` would read as 24)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            keys = {k for k, _ in pairs}
            names = [v for k, v in pairs if k == "name" and isinstance(v, str)]
            if names:
                where = f"table {names[0]!r}"
            elif keys & {"format", "tables", "batch_size"}:
                where = "the plan"
            elif keys & set(_TOPOLOGY_KEYS):
                where = "the plan topology"
            else:
                where = "an object"
            raise PlanError(
                f"plan JSON: key {key!r} is given twice in {where} "
                f"({out[key]!r} and {value!r}); give it once"
            )
        out[key] = value
    return out


def _validate_table(t: TablePlan, num_devices: int) -> None:
    name = t.name
    for field in ("row_shards", "column_shards"):
        if getattr(t, field) < 1:
            raise PlanError(f"table {name!r}: {field} must be >= 1, got {getattr(t, field)}")
    if t.cluster is Cluster.DP:
        want = tuple(range(num_devices))
        if t.row_shards != 1 or t.column_shards != 1 or t.devices != (want,):
            raise PlanError(
                f"table {name!r}: a dp table is replicated: row_shards 1, column_shards 1 and "
                f"devices [[0, ..., {num_devices - 1}]]; got r={t.row_shards}, "
                f"c={t.column_shards}, devices={[list(c) for c in t.devices]}"
            )
        return
    if len(t.devices) != t.column_shards or any(len(c) != t.row_shards for c in t.devices):
        raise PlanError(
            f"table {name!r}: devices must be [column_shards={t.column_shards}]"
            f"[row_shards={t.row_shards}], got {[list(c) for c in t.devices]}"
        )
    flat = [d for c in t.devices for d in c]
    for d in flat:
        if not 0 <= d < num_devices:
            raise PlanError(f"table {name!r}: device {d} out of range [0, {num_devices})")
    if len(set(flat)) != len(flat):
        dup = next(d for d in flat if flat.count(d) > 1)
        raise PlanError(f"table {name!r}: device {dup} holds two shards of the table")
    if t.capacity_factor is not None and t.capacity_factor <= 0:
        raise PlanError(f"table {name!r}: capacity_factor must be > 0, got {t.capacity_factor}")
    if t.unique_capacity is not None and t.unique_capacity < 1:
        raise PlanError(f"table {name!r}: unique_capacity must be >= 1, got {t.unique_capacity}")


_PLAN_KEYS = frozenset({"format", "topology", "batch_size", "tables"})
_TOPOLOGY_KEYS = frozenset({"num_nodes", "devices_per_node"})
_TABLE_REQUIRED = frozenset({"name", "cluster", "row_shards", "column_shards", "devices"})
_TABLE_KEYS = _TABLE_REQUIRED | {"capacity_factor", "unique_capacity"}


def _few(names: list[str], limit: int = 8) -> str:
    """`['a', 'b']`, or the first `limit` names and how many more."""
    if len(names) <= limit:
        return str(names)
    return f"{names[:limit]} and {len(names) - limit} more"


def _check_keys(obj: dict, known: frozenset, required: frozenset, where: str) -> None:
    unknown, _ = name_mismatch(obj, known)
    if unknown:
        raise PlanError(f"{where}: unknown field {unknown[0]!r}; expected {sorted(known)}")
    _, missing = name_mismatch(obj, required)
    if missing:
        raise PlanError(f"{where}: missing field {missing[0]!r}")


def _as_int(value: Any, where: str) -> int:
    """`value` as an int; a bool, a float (even 16.0) or a string is an error, not truncated."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise PlanError(f"{where} must be an integer, got {value!r}")
    return int(value)


def _as_devices(devices: Any, where: str) -> tuple[tuple[int, ...], ...]:
    if isinstance(devices, str | bytes) or not isinstance(devices, Sequence | np.ndarray):
        raise PlanError(f"{where}: devices must be a list of lists of ints, got {devices!r}")
    out = []
    for col in devices:
        if isinstance(col, str | bytes) or not isinstance(col, Sequence | np.ndarray):
            raise PlanError(f"{where}: devices must be a list of lists of ints, got {devices!r}")
        out.append(tuple(_as_int(d, f"{where}: device") for d in col))
    return tuple(out)
