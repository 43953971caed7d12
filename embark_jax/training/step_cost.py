"""Checks that a compiled training step costs what its batch costs (docs/design.md §8).

A step's real work is O(ids x dim): gather the rows the batch names, scatter their updates.
Anything that reads, copies or rewrites a whole table or optimizer slot per step makes it
O(table). `whole_table_ops` lists such operations in a compiled step's optimized HLO: every
instruction of the entry computation that produces or consumes an array of a table's or a
slot's per-device shape, other than parameters, bitcasts, tuples and their elements, and the
kernels that touch only rows (lookup, the staged update, the in-place commit). Shapes are
matched exactly, so the check is meant for tables larger than any batch-sized array.
`memory_summary` puts `memory_analysis()` next to the state's bytes.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax

__all__ = ["ROW_KERNELS", "memory_summary", "whole_table_ops"]

# Custom calls that take a whole table but touch only the rows their ids name.
ROW_KERNELS = (
    "embark_lookup_pool",
    "embark_sparse_grad_stage",
    "embark_commit_rows",
    "embark_sparse_grad_update",
    "embark_sparse_update",
)
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_ALLOWED = {"parameter", "bitcast", "get-tuple-element", "tuple"}


def _local_shapes(state, num_devices: int) -> set[tuple[int, ...]]:
    """Per-device shapes of every table and slot leaf (leading device axis split), with and
    without the leading 1 of a `shard_map` block."""
    shapes = set()
    for tree in (state.tables, state.slots):
        for x in jax.tree.leaves(tree):
            if x.ndim < 2 or x.shape[0] % num_devices:
                continue
            local = (x.shape[0] // num_devices, *x.shape[1:])
            if math.prod(local) > 1:
                shapes.add(local)
                if local[0] == 1:
                    shapes.add(local[1:])
    return shapes


def _entry(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside:
            lines.append(line)
    return lines


def _dims(type_text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in m.group(1).split(",") if d) for m in _SHAPE.finditer(type_text)]


def whole_table_ops(compiled: Any, state, num_devices: int) -> list[str]:
    """Instructions of `compiled` (a `jax.stages.Compiled` train step) that read, copy or
    write a whole table or slot of `state` (a `TrainState`); empty for a step that costs
    O(ids). Each entry is the instruction's HLO line, shortened."""
    shapes = _local_shapes(state, num_devices)
    found: dict[str, list[tuple[int, ...]]] = {}
    bad = []
    for line in _entry(compiled.as_text()):
        m = _INSTR.match(line)
        if not m:
            continue
        name, result, op, rest = m.groups()
        found[name] = _dims(result)
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        touches = any(s in shapes for s in found[name]) or any(
            s in shapes for o in operands for s in found.get(o, [])
        )
        if not touches or op in _ALLOWED:
            continue
        if op == "custom-call" and any(f'"{k}"' in line for k in ROW_KERNELS):
            continue
        bad.append(line.strip()[:200])
    return bad


def memory_summary(compiled: Any, state) -> dict[str, float]:
    """`memory_analysis()` of a compiled step (bytes per device) beside the bytes of the
    state's tables and slots per device: `aliased` should cover them, `temp` stay small."""
    ma = compiled.memory_analysis()
    table_bytes = sum(
        x.addressable_data(0).nbytes for x in jax.tree.leaves((state.tables, state.slots))
    )
    return {
        "table_and_slot_bytes": float(table_bytes),
        "argument_bytes": float(ma.argument_size_in_bytes),
        "output_bytes": float(ma.output_size_in_bytes),
        "alias_bytes": float(ma.alias_size_in_bytes),
        "temp_bytes": float(ma.temp_size_in_bytes),
        "temp_fraction": ma.temp_size_in_bytes / max(table_bytes, 1),
    }
