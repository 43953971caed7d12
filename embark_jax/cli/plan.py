"""`python -m embark_jax plan` and `python -m embark_jax simulate`."""

from __future__ import annotations

import argparse
import json
import time

from embark_jax.cli.errors import (
    CLIError,
    check_writable_file,
    make_parent,
    model_name,
    models_help,
    positive_int,
    topology_name,
)
from embark_jax.cli.flags import add_batch_size, add_counts
from embark_jax.planner import (
    BASELINES,
    PRESETS,
    PlannerError,
    baseline,
    get_hardware,
    load_preset,
    plan,
    report,
)

SIM_MODELS = ("dcnv2", "t180", "t200", "t510")
SIM_NODES = (1, 8, 16)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_name, default="dcnv2", help=models_help())
    add_counts(
        p,
        {"--nodes": (1, "nodes in the cluster"), "--devices-per-node": (8, "devices per node")},
    )
    add_batch_size(p, "the paper's MLPerf batch for the cluster size")
    p.add_argument(
        "--topology",
        type=topology_name,
        default="dgx-h100",
        help=f"hardware to price: {', '.join(sorted(PRESETS))} or local (measured here)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        choices=BASELINES,
        help="plan a baseline instead of the planner's plan (default: the planner's plan)",
    )
    p.add_argument("--out", default=None, help="write the plan JSON here (default: not written)")
    p.add_argument(
        "--plot",
        default=None,
        help="write a PNG of per-device load and memory (needs matplotlib; default: none)",
    )
    p.add_argument("--max-rounds", type=positive_int, default=20, help="refinement rounds")


def default_batch(model, nodes: int, per_node: int) -> int:
    b = model.default_batch.get(f"{nodes}x{per_node}", 65536)
    g = nodes * per_node
    return max(g, b // g * g)


def run_plan(args) -> int:
    model = load_preset(args.model)
    for path, flag in ((args.out, "--out"), (args.plot, "--plot")):
        if path:
            check_writable_file(path, flag)
    g = args.nodes * args.devices_per_node
    if args.batch_size is not None and args.batch_size % g:
        raise CLIError(f"--batch-size {args.batch_size} is not a multiple of the {g} devices")
    hw = get_hardware(args.topology, args.nodes, args.devices_per_node)
    batch = args.batch_size or default_batch(model, args.nodes, args.devices_per_node)
    t0 = time.perf_counter()
    ev = (
        baseline(model, batch, hw, args.baseline)
        if args.baseline
        else plan(model, batch, hw, max_rounds=args.max_rounds)
    )
    elapsed = time.perf_counter() - t0
    print(report.summary(ev))
    trw = None
    if not args.baseline:
        try:
            trw = baseline(model, batch, hw, "trw")
        except PlannerError:
            trw = None
    for line in plan_notes(ev, trw, out_flag=None if args.out else "--out plan.json"):
        print(line)
    print(f"planned in {elapsed:.2f} s")
    if args.out:
        ev.plan.to_json(make_parent(args.out))
        print(f"wrote {args.out}")
    if args.plot:
        report.plot(
            ev,
            make_parent(args.plot),
            f"{args.model} on {args.nodes}x{args.devices_per_node} "
            f"{hw.name}: {ev.name} {ev.step_s * 1e3:.2f} ms",
        )
        print(f"wrote {args.plot}")
    return 0


def plan_notes(ev, trw=None, *, out_flag: str | None = None, max_tables: int = 40) -> list[str]:
    """One line for each thing in a plan summary that looks wrong but is not: tables left
    out of the summary, devices with almost no table memory, a higher communication share
    than TRW together with a faster step."""
    notes = []
    hidden = len(ev.plan.tables) - max_tables
    if hidden > 0 and out_flag:
        notes.append(
            f"  (to get the plan JSON with all {len(ev.plan.tables)} tables: add {out_flag})"
        )
    mem = ev.device_memory
    if len(mem) > 1 and mem.max() > 0:
        light = [d for d in range(len(mem)) if mem[d] < 0.05 * mem.max()]
        if light:
            notes.append(
                f"note: device(s) {_few(light)} hold under 5% of the largest device's table "
                "memory: the planner balances predicted step time, not memory, and these "
                "devices are kept busy by lookups and communication instead of large tables"
            )
    if trw is not None and ev.comm_share > trw.comm_share and ev.step_s < trw.step_s:
        ours_ms, trw_ms = ev.comm_share * ev.step_s * 1e3, trw.comm_share * trw.step_s * 1e3
        why = (
            "its step is shorter, so less communication is a larger share of it"
            if ours_ms <= trw_ms
            else "it moves more bytes but balances the devices' compute better"
        )
        notes.append(
            f"note: communication is {100 * ev.comm_share:.1f}% of this plan's step vs "
            f"{100 * trw.comm_share:.1f}% for TRW ({ours_ms:.3f} vs {trw_ms:.3f} ms), yet the "
            f"step is {trw.step_s / ev.step_s:.2f}x faster: {why}"
        )
    return notes


def _few(items: list[int], limit: int = 8) -> str:
    text = ", ".join(str(i) for i in items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def run_simulate(args) -> int:
    if args.out:
        check_writable_file(args.out, "--out")
    rows = []
    print(
        f"{'model':8s} {'nodes':>5s} {'batch':>7s} {'embark ms':>10s} {'trw ms':>9s} "
        f"{'speedup':>7s} {'comm% ours':>10s} {'comm% trw':>9s}  clusters (dp/rb/ub)"
    )
    for name in args.models:
        model = load_preset(name)
        for nodes in args.nodes:
            hw = get_hardware(args.topology, nodes, 8)
            batch = default_batch(model, nodes, 8)
            row = {"model": name, "nodes": nodes, "devices": hw.num_devices, "batch": batch}
            try:
                ours = plan(model, batch, hw)
                row.update(embark_ms=ours.step_s * 1e3, embark_comm_share=ours.comm_share)
                counts = {
                    c: sum(1 for t in ours.plan.tables if t.cluster.value == c)
                    for c in ("dp", "rb", "ub")
                }
                row["clusters"] = counts
            except PlannerError as e:
                row["error"] = str(e)
                print(f"{name:8s} {nodes:5d} {batch:7d}  does not fit: {e}")
                rows.append(row)
                continue
            try:
                # the paper's TRW as HugeCTR runs it: priced for time, without our memory cap
                # (it updates in place and stages nothing, see docs/design.md "Memory")
                trw = baseline(model, batch, hw, "trw", memory_fraction=None)
                row.update(
                    trw_ms=trw.step_s * 1e3,
                    trw_comm_share=trw.comm_share,
                    speedup=trw.step_s / ours.step_s,
                )
                t_txt = (
                    f"{trw.step_s * 1e3:9.2f} {row['speedup']:7.2f} "
                    f"{100 * ours.comm_share:10.1f} {100 * trw.comm_share:9.1f}"
                )
            except PlannerError:
                t_txt = f"{'n/a':>9s} {'n/a':>7s} {100 * ours.comm_share:10.1f} {'(no fit)':>9s}"
            print(
                f"{name:8s} {nodes:5d} {batch:7d} {ours.step_s * 1e3:10.2f} {t_txt}  "
                f"{counts['dp']}/{counts['rb']}/{counts['ub']}",
                flush=True,
            )
            rows.append(row)
    speedups = [r["speedup"] for r in rows if "speedup" in r]
    if speedups:
        print(
            f"\nspeedup over TRW: mean {sum(speedups) / len(speedups):.2f}x, max "
            f"{max(speedups):.2f}x (paper: 1.5x mean, 1.77x max on DGX H100)"
        )
    higher = [r for r in rows if r.get("speedup", 0) > 1 and _comm_higher(r)]
    if higher:
        print(
            f"note: in {len(higher)} row(s) our comm% is above TRW's while our step is faster: "
            "comm% is each plan's share of its own (shorter) step, not more communication"
        )
    if args.out:
        with open(make_parent(args.out), "w") as fh:
            json.dump({"topology": args.topology, "rows": rows}, fh, indent=1)
        print(f"wrote {args.out}")
    return 0


def _comm_higher(row: dict) -> bool:
    return row.get("embark_comm_share", 0) > row.get("trw_comm_share", 1)


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        nargs="+",
        type=model_name,
        default=list(SIM_MODELS),
        help=f"models to simulate; {models_help()}",
    )
    p.add_argument(
        "--nodes", nargs="+", type=positive_int, default=list(SIM_NODES), help="node counts"
    )
    p.add_argument(
        "--topology",
        type=topology_name,
        default="dgx-h100",
        help=f"hardware to price: {', '.join(sorted(PRESETS))} or local",
    )
    p.add_argument("--out", default=None, help="write the rows as JSON (default: not written)")
