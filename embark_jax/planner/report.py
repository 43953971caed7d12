"""Stage `report`: human-readable planner output. `summary` gives the predicted step, the
lower bound, their ratio and where the difference comes from (`bound_lines`), the
per-cluster and per-device views and every table's placement with its reason (from
`explain`); `plot` draws per-device time and memory as a PNG (matplotlib, loaded lazily)."""

from __future__ import annotations

import io
import math
from collections import defaultdict

import numpy as np

from embark_jax.planner.types import Evaluation

__all__ = ["RATIO_GOAL", "bound_lines", "plot", "summary"]

RATIO_GOAL = 1.2  # a plan further than this from its bound says what keeps it there


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f} ms"


def summary(ev: Evaluation, *, max_tables: int = 40, max_devices: int = 16) -> str:
    out = io.StringIO()
    p = ev.plan
    topo = p.topology
    out.write(
        f"plan '{ev.name}': {len(p.tables)} tables on {topo.num_nodes} node(s) x "
        f"{topo.devices_per_node} devices, global batch {p.batch_size}\n"
    )
    out.write(
        f"predicted step {_ms(ev.step_s)} = embedding {_ms(ev.embedding_s)} (bottleneck "
        f"device {ev.bottleneck}: compute {_ms(ev.device_compute[ev.bottleneck])}, comm "
        f"intra {_ms(ev.device_intra[ev.bottleneck])}, inter "
        f"{_ms(ev.device_inter[ev.bottleneck])}) + dense {_ms(ev.dense_s)}; "
        f"communication {100 * ev.comm_share:.1f}% of the step\n"
    )
    out.write(bound_lines(ev) + "\n")
    by_cluster: dict[str, list] = defaultdict(list)
    for t in p.tables:
        by_cluster[t.cluster.value].append(t)
    out.write("clusters:\n")
    for cl in sorted(by_cluster):
        ts = by_cluster[cl]
        split = sum(1 for t in ts if t.row_shards * t.column_shards > 1)
        out.write(f"  {cl}: {len(ts)} tables ({split} split by rows/columns)\n")
    out.write("\ndevices (time = compute + comm; memory in GB):\n")
    order = np.argsort(-ev.device_time)[:max_devices]
    for d in sorted(order.tolist()):
        out.write(
            f"  dev {d:4d} node {d // topo.devices_per_node:3d}: {_ms(ev.device_time[d])} "
            f"(compute {_ms(ev.device_compute[d])}, intra {_ms(ev.device_intra[d])}, "
            f"inter {_ms(ev.device_inter[d])}), memory {ev.device_memory[d] / 1e9:.2f}\n"
        )
    if len(order) < topo.num_devices:
        out.write(f"  ... {topo.num_devices - len(order)} less loaded devices not shown\n")
    out.write("\ntables (cluster, r x c, devices, why):\n")
    for t in p.tables[:max_tables]:
        devs = [list(c) for c in t.devices]
        shown = devs if sum(len(c) for c in devs) <= 8 else f"{sum(len(c) for c in devs)} devices"
        out.write(
            f"  {t.name}: {t.cluster.value} {t.row_shards}x{t.column_shards} {shown} -- "
            f"{ev.reasons.get(t.name, '')}\n"
        )
    if len(p.tables) > max_tables:
        out.write(f"  ... {len(p.tables) - max_tables} more tables (see the plan JSON)\n")
    return out.getvalue()


def bound_lines(ev: Evaluation) -> str:
    """The bound, the ratio and the gap's parts, one item per line."""
    b, g = ev.bound, ev.gap
    if b is None:
        return ""
    if not math.isfinite(b.step_s):
        return "lower bound: none (some table fits the memory cap with no option)\n"
    what = (
        "every table's cheapest option spread over all devices"
        if b.binding == "mean"
        else f"the {b.binding}: its smallest shard plus every device's uniform work"
    )
    lines = [
        f"lower bound {_ms(b.step_s)} (embedding {_ms(b.embedding_s)}: {what}; + dense "
        f"{_ms(b.dense_s)}); predicted / bound = {ev.bound_ratio:.2f}x"
    ]
    if g is not None:
        top = ", ".join(f"{n} +{_ms(s)}" for n, s in g.tables[:3] if s >= 5e-7)
        lines.append(
            f"  gap {_ms(g.step_s - g.bound_s)}: imbalance {_ms(g.imbalance_s)} (busiest "
            f"device {_ms(float(ev.device_time.max()))} vs mean {_ms(float(ev.device_time.mean()))})"
            f"; work above the relaxation's options {_ms(g.extra_work_s)}"
            + (f" (most: {top})" if top else "")
        )
    ruled = [t for t in b.tables if t.ruled_out]
    if ruled:
        shown = "; ".join(f"{t.table}: {t.ruled_out}" for t in ruled[:3])
        more = f"; ... {len(ruled) - 3} more" if len(ruled) > 3 else ""
        lines.append(
            f"  memory: the cap rules out options of {len(ruled)} table(s) ({shown}{more}), "
            f"raising the bound by {_ms(b.step_s - b.unconstrained_s)}"
        )
    else:
        lines.append("  memory: the cap rules out no option")
    if ev.bound_ratio is not None and ev.bound_ratio > RATIO_GOAL and g is not None:
        lines.append("  above " + f"{RATIO_GOAL}x: " + _limit(ev))
    return "\n".join(lines) + "\n"


def _limit(ev: Evaluation) -> str:
    """What keeps a plan above the goal, from the gap's largest part."""
    g = ev.gap
    if g.imbalance_s >= g.extra_work_s:
        return (
            "mostly imbalance: the busiest device's shards cannot be split or moved to "
            "lower it (shards too coarse for the devices, or the memory cap)"
        )
    return (
        "mostly work above the relaxation: smaller shards to balance cost more "
        "device-seconds (routing and pooling per shard) than the bound spreads"
    )


def plot(ev: Evaluation, path: str, title: str | None = None) -> None:
    """PNG of per-device time (compute / intra / inter) and memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = len(ev.device_time)
    x = np.arange(g)
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(6, g * 0.08 + 4), 6), sharex=True)
    a.bar(x, ev.device_compute * 1e3, label="compute")
    a.bar(x, ev.device_intra * 1e3, bottom=ev.device_compute * 1e3, label="comm intra-node")
    a.bar(
        x,
        ev.device_inter * 1e3,
        bottom=(ev.device_compute + ev.device_intra) * 1e3,
        label="comm inter-node",
    )
    a.set_ylabel("ms per step")
    a.legend(loc="upper right", fontsize=8)
    a.set_title(title or f"{ev.name}: predicted step {ev.step_s * 1e3:.2f} ms")
    b.bar(x, ev.device_memory / 1e9, color="gray")
    b.set_ylabel("memory (GB)")
    b.set_xlabel("device")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
