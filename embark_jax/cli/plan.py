"""`python -m embark_jax plan` and `python -m embark_jax simulate`."""

from __future__ import annotations

import argparse
import json
import time

from embark_jax.planner import (
    BASELINES,
    PRESETS,
    PlannerError,
    baseline,
    get_hardware,
    load_preset,
    plan,
    preset_names,
    report,
)

SIM_MODELS = ("dcnv2", "t180", "t200", "t510")
SIM_NODES = (1, 8, 16)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dcnv2", choices=preset_names())
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch (default: the paper's MLPerf batch for the cluster size)",
    )
    p.add_argument("--topology", default="dgx-h100", help=f"{sorted(PRESETS)} or 'local'")
    p.add_argument("--baseline", default=None, choices=BASELINES)
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of per-device load and memory")
    p.add_argument("--max-rounds", type=int, default=20)


def default_batch(model, nodes: int, per_node: int) -> int:
    b = model.default_batch.get(f"{nodes}x{per_node}", 65536)
    g = nodes * per_node
    return max(g, b // g * g)


def run_plan(args) -> int:
    model = load_preset(args.model)
    hw = get_hardware(args.topology, args.nodes, args.devices_per_node)
    batch = args.batch_size or default_batch(model, args.nodes, args.devices_per_node)
    t0 = time.perf_counter()
    try:
        ev = (
            baseline(model, batch, hw, args.baseline)
            if args.baseline
            else plan(model, batch, hw, max_rounds=args.max_rounds)
        )
    except PlannerError as e:
        print(f"error: {e}")
        return 2
    print(report.summary(ev))
    print(f"planned in {time.perf_counter() - t0:.2f} s")
    if args.out:
        ev.plan.to_json(args.out)
        print(f"wrote {args.out}")
    if args.plot:
        report.plot(
            ev,
            args.plot,
            f"{args.model} on {args.nodes}x{args.devices_per_node} "
            f"{hw.name}: {ev.name} {ev.step_s * 1e3:.2f} ms",
        )
        print(f"wrote {args.plot}")
    return 0


def run_simulate(args) -> int:
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
                trw = baseline(model, batch, hw, "trw")
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
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"topology": args.topology, "rows": rows}, fh, indent=1)
        print(f"wrote {args.out}")
    return 0


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(SIM_MODELS))
    p.add_argument("--nodes", nargs="+", type=int, default=list(SIM_NODES))
    p.add_argument("--topology", default="dgx-h100")
    p.add_argument("--out", default=None, help="write the rows as JSON")
