"""Communication accounting: the bytes of every collective of a compiled step, read from its
HLO. This is how RB/UB/hierarchical savings are verified without a real network.

Bytes are per device: the size of the collective's result (for an all-to-all that is what a
device sends and receives, its own slice included; for an all-reduce the reduced buffer; for
an all-gather the gathered buffer). Each collective is attributed to the mesh axes its
replica groups span (`local`, `node`, `device` or `all`); `link_bytes` splits them into
intra-node and inter-node traffic.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections import defaultdict
from collections.abc import Sequence

import jax.numpy as jnp

from embark_jax.sharding import hlo_scan

__all__ = ["Collective", "collective_bytes", "collectives", "link_bytes", "wire_bytes"]

# HLO element type -> bytes, from the one table of element types (`hlo_scan.HLO_DTYPES`)
_DTYPE_BYTES = {hlo: jnp.dtype(name).itemsize for name, hlo in hlo_scan.HLO_DTYPES.items()}
_KINDS = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the step and the mesh axis its replica groups span."""

    instr: hlo_scan.Instr
    axis: str

    @property
    def kind(self) -> str:
        """The opcode without an asynchronous `-start` suffix (`all-to-all`, ...)."""
        return self.instr.opcode.removesuffix("-start")

    @property
    def bytes(self) -> int:
        """Bytes of every array of the result (a tuple's arrays summed)."""
        total = 0
        for dtype, dims in self.instr.arrays:
            total += math.prod(dims) * _DTYPE_BYTES.get(dtype, 1)  # the rest: f8 types
        return total

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.instr.arrays)


def _axis_of(line: str, mesh_shape: Sequence[int], axis_names: Sequence[str]) -> str:
    m = _GROUPS.search(line)
    total = 1
    for s in mesh_shape:
        total *= s
    if not m:
        return "all" if len(axis_names) > 1 else axis_names[0]
    groups = [
        [int(x) for x in g.strip("{}").split(",") if x]
        for g in re.findall(r"\{[\d,]*\}", m.group(1))
    ]
    size = len(groups[0])
    if len(axis_names) == 1 or size == total:
        return axis_names[0] if len(axis_names) == 1 else "all"
    n_nodes, local = mesh_shape
    g0 = sorted(groups[0])
    if size == local and g0 == list(range(g0[0], g0[0] + local)):
        return axis_names[1]
    if size == n_nodes and all(b - a == local for a, b in itertools.pairwise(g0)):
        return axis_names[0]
    return "mixed"


def collectives(
    compiled_or_text, mesh_shape: Sequence[int], axis_names: Sequence[str]
) -> list[Collective]:
    """Every collective in the (compiled) HLO with its per-device bytes and mesh axis."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    out = []
    for line in text.splitlines():
        ins = hlo_scan.instruction(line)
        if ins is None or ins.opcode.removesuffix("-start") not in _KINDS:
            continue
        out.append(Collective(ins, _axis_of(line, mesh_shape, axis_names)))
    return out


def collective_bytes(
    compiled_or_text,
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    *,
    floats_only: bool = False,
) -> dict[tuple[str, str], int]:
    """`{(kind, axis): bytes}` summed over the step's collectives. `floats_only` counts only
    floating-point payloads (embedding vectors and gradients, not routed ids)."""
    acc: dict[tuple[str, str], int] = defaultdict(int)
    for c in collectives(compiled_or_text, mesh_shape, axis_names):
        if floats_only and not any(d.startswith(("f", "bf")) for d in c.dtypes):
            continue
        acc[(c.kind, c.axis)] += c.bytes
    return dict(acc)


def link_bytes(by_axis: dict[tuple[str, str], int], mesh_shape: Sequence[int]) -> dict[str, float]:
    """Splits per-axis bytes into intra-node and inter-node traffic: `local` stays in a node,
    `node` crosses nodes, an all-device collective crosses for (G - L) / G of its bytes."""
    if len(mesh_shape) == 1:
        return {"intra": float(sum(by_axis.values())), "inter": 0.0}
    n_nodes, local = mesh_shape
    g = n_nodes * local
    intra = inter = 0.0
    for (_, axis), b in by_axis.items():
        if axis == "local":
            intra += b
        elif axis == "node":
            inter += b
        else:
            inter += b * (g - local) / g
            intra += b * local / g
    return {"intra": intra, "inter": inter}


def _peers(axis: str, mesh_shape: Sequence[int]) -> tuple[int, int, int]:
    """(peers in the collective's groups, of which in the same node, of which on others)."""
    if len(mesh_shape) == 1:
        return mesh_shape[0], mesh_shape[0], 0
    n_nodes, local = mesh_shape
    if axis == "local":
        return local, local, 0
    if axis == "node":
        return n_nodes, 1, n_nodes - 1
    return n_nodes * local, local, n_nodes * local - local  # all devices (or mixed)


def wire_bytes(
    compiled_or_text, mesh_shape: Sequence[int], axis_names: Sequence[str]
) -> dict[str, float]:
    """Bytes each device sends over intra-node and inter-node links in the step (per
    direction), the convention of the planner's cost model: an all-to-all or all-gather of
    n peers moves (n - 1) / n of its result (the own slice stays), an all-reduce is priced
    as a hierarchical ring: 2 (L - 1) / L of the buffer inside the node and 2 / L (N - 1) / N
    across nodes."""
    intra = inter = 0.0
    for c in collectives(compiled_or_text, mesh_shape, axis_names):
        n, same, other = _peers(c.axis, mesh_shape)
        if c.kind == "all-reduce":
            nodes = n // same
            intra += 2 * c.bytes * (same - 1) / same
            inter += 2 * c.bytes / same * (nodes - 1) / nodes
        elif c.kind == "reduce-scatter":  # the result is one of n pieces
            intra += c.bytes * (same - 1)
            inter += c.bytes * other
        else:  # all-to-all, all-gather, collective-permute: per peer result / n
            intra += c.bytes / n * (same - 1)
            inter += c.bytes / n * other
    return {"intra": intra, "inter": inter}
