"""Checks that a compiled training step costs what its batch costs (docs/design.md §8).

A step's real work is O(ids x dim): gather the rows the batch names, scatter their updates.
Anything that reads, copies or writes a whole table or optimizer slot per step makes it
O(table). `whole_table_ops` lists such operations of a compiled step
(`sharding.hlo_scan.scan` over the state's tables and slots); `memory_summary` puts
`memory_analysis()` next to the state's bytes.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from embark_jax.sharding import hlo_scan

__all__ = ["memory_summary", "state_buffers", "whole_table_ops"]


def state_buffers(state, num_devices: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`{name: (dtype, per-device shape)}` of every table and slot array of `state` (their
    leading axis is split over the devices)."""
    out = {}
    for kind, tree in (("tables", state.tables), ("slots", state.slots)):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        for path, x in leaves:
            if x.ndim < 2 or x.shape[0] % num_devices:
                continue  # a per-device counter (Adam's), not a table-sized buffer
            local = (x.shape[0] // num_devices, *x.shape[1:])
            out[f"{kind}{jax.tree_util.keystr(path)}"] = (str(np.dtype(x.dtype)), local)
    return out


def whole_table_ops(compiled: Any, state, num_devices: int) -> list[dict]:
    """Instructions of `compiled` (a `jax.stages.Compiled` train step) that read, copy or
    write a whole table or slot of `state` (`hlo_scan.scan`'s entries); empty for a step
    that costs O(ids)."""
    return hlo_scan.scan(compiled.as_text(), state_buffers(state, num_devices))


def memory_summary(compiled: Any, state) -> dict[str, float]:
    """`memory_analysis()` of a compiled step (bytes per device) beside the bytes of the
    state's tables and slots per device: `alias_bytes` should cover them, `temp_bytes`
    stay small."""
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
