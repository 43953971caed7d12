"""Turns per-repetition times into the JSON's per-op records and the printed ratio tables.

Pure functions of numbers (unit-tested with fake times). A ratio "ours vs PEER" is a speed
ratio, PEER's time / ours: above 1 ours is faster ("3.2x faster" is 3.2; "0.21x" is torch
being about 5x faster). Each ratio is given for the min and for the median
times of both.
"""

from __future__ import annotations

import math
import statistics

from experiments.kernels import points as P

OURS = "embark"
PEERS = ("xla", "torch", "torch_segment_reduce")
FUSED = "fused"  # backward_two_op's ratio against our own fused backward


def summarize(times: list[float], nbytes: int) -> dict:
    """min, median, every time, and GB/s at the min and at the median."""
    lo, med = min(times), statistics.median(times)
    return {
        "min_s": lo,
        "median_s": med,
        "times_s": list(times),
        "reps": len(times),
        "GBps": nbytes / lo / 1e9,
        "GBps_median": nbytes / med / 1e9,
    }


def ratio(ours: dict | None, peer: dict | None) -> dict | None:
    """`{"min": peer.min_s / ours.min_s, "median": ...}`, or None when either is missing."""
    if not ours or not peer:
        return None
    return {
        "min": peer["min_s"] / ours["min_s"],
        "median": peer["median_s"] / ours["median_s"],
    }


def op_record(
    op: str,
    nbytes: int,
    libs: dict[str, dict],
    peer_libs: dict[str, dict] | None = None,
    copy_GBps: float | None = None,
) -> dict:
    """One op at one point: `libs` (impl -> `summarize` record), ratios of ours against each
    peer (taken from `peer_libs`, the peer op's libs, when the op is ours only), and the
    flat keys older readers use (`ffi_s`, `xla_s`, `ffi_GBps`, `xla_GBps`, `speedup`: XLA
    time / ours, all at the min; `fraction_of_copy`: ours at the min / copy bandwidth)."""
    ours = libs.get(OURS)
    if peer_libs is None:
        peers = {k: v for k, v in libs.items() if k != OURS}
    else:
        peers = {(FUSED if k == OURS else k): v for k, v in peer_libs.items()}
    rec = {"op": op, "bytes": nbytes, "libs": libs, "ratios": {}}
    for name, peer in peers.items():
        r = ratio(ours, peer)
        if r is not None:
            rec["ratios"][name] = r
    if ours:
        rec |= {"ffi_s": ours["min_s"], "ffi_GBps": ours["GBps"]}
        if copy_GBps:
            rec["fraction_of_copy"] = ours["GBps"] / copy_GBps
    for name in ("xla", "torch"):
        if name in peers:
            rec |= {f"{name}_s": peers[name]["min_s"], f"{name}_GBps": peers[name]["GBps"]}
    if "xla" in rec["ratios"]:
        rec["speedup"] = rec["ratios"]["xla"]["min"]
    return rec


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _pair(r: dict | None, fmt: str) -> str:
    if not r:
        return "—"
    return f"{r['min']:{fmt}} / {r['median']:{fmt}}"


def _ratio_cell(r: dict | None) -> str:
    return "—" if not r else f"{r['min']:.2f}x / {r['median']:.2f}x"


def table_columns(op: str, records: list[dict]) -> list[str]:
    """Peers that appear at any point of this op, in a fixed order."""
    seen = {k for rec in records for k in rec.get("ratios", {})}
    return [k for k in (FUSED, *PEERS) if k in seen]


def ratio_table(
    op: str,
    rows: list[tuple[str, dict]],
    absent: dict[str, str] | None = None,
    with_geomean: bool = True,
) -> str:
    """The printed table for one op: one row per point (`label`, op record), ours in ms and
    GB/s, then `ours vs PEER` for each peer measured, each as min / median; a geometric-mean
    row when there is more than one point (unless not `with_geomean`). `absent`: peers not
    measured and why (a note)."""
    recs = [r for _, r in rows]
    cols = table_columns(op, recs)
    head = ["B × L × D, V", "ours ms (min / median)", "GB/s (min)"]
    head += [f"ours vs {c} (min / median)" for c in cols]
    lines = [f"### {op}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rec in rows:
        ours = rec.get("libs", {}).get(OURS)
        ms = {"min": ours["min_s"] * 1e3, "median": ours["median_s"] * 1e3} if ours else None
        cells = [label, _pair(ms, ".3f"), f"{ours['GBps']:.2f}" if ours else "—"]
        cells += [_ratio_cell(rec["ratios"].get(c)) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    if with_geomean and len(rows) > 1 and cols:
        cells = ["geometric mean", "", ""]
        for c in cols:
            g = {
                k: geomean([r["ratios"][c][k] for r in recs if c in r["ratios"]])
                for k in ("min", "median")
            }
            cells.append(_ratio_cell(g if None not in g.values() else None))
        lines.append("| " + " | ".join(cells) + " |")
    for name, why in (absent or {}).items():
        lines.append(f"\n{name}: not measured ({why}); its column is left out.")
    return "\n".join(lines)


def tables(result: dict) -> str:
    """Every op's table, the headline (fp32 forward) first; a `--floor` run's split last (and
    no geometric mean over its call of one id)."""
    absent = {k: v for k, v in result.get("unavailable", {}).items()}
    out = []
    for op in result.get("ops", P.OPS):
        rows = [(_label(pt), pt[op]) for pt in result["points"] if op in pt]
        if rows:
            note = absent if op == "forward" else None
            out.append(ratio_table(op, rows, note, with_geomean="floor" not in result))
    if "floor" in result:
        out.append(floor_table(result["floor"], _label(result["points"][-1])))
    return "\n\n".join(out)


def floor_split(result: dict) -> dict:
    """A `--floor` run (points: one id, then a shape): per op and library, at the min, the
    time of a call of one id (`call_us`: the fixed price per call), of the shape (`shape_us`)
    and their difference (`rows_us`: what the shape's rows cost above that price)."""
    first, shape = result["points"][0], result["points"][-1]
    split = {}
    for op in result.get("ops", P.OPS):
        libs = {}
        for lib, one in first.get(op, {}).get("libs", {}).items():
            full = shape.get(op, {}).get("libs", {}).get(lib)
            if full:
                call, whole = one["min_s"] * 1e6, full["min_s"] * 1e6
                libs[lib] = {"call_us": call, "shape_us": whole, "rows_us": whole - call}
        split[op] = libs
    return split


def floor_table(split: dict, shape_label: str) -> str:
    """`floor_split` as a table: one row per op and library, in microseconds at the min."""
    head = ["op", "library", "one id: us", f"{shape_label}: us", "difference (its rows): us"]
    lines = ["### per-call floor (min)", "", "| " + " | ".join(head) + " |"]
    lines.append("|" + "---|" * len(head))
    for op, libs in split.items():
        for lib, r in libs.items():
            cells = [op, lib, *(f"{r[k]:.1f}" for k in ("call_us", "shape_us", "rows_us"))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _label(pt: dict) -> str:
    return P.Point.from_json(pt["point"]).label
