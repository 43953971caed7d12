"""The paper's evaluation, predicted: end-to-end step time of our plan vs the TRW baseline for
DLRM-DCNv2, T180, T200 and T510 on 1, 8 and 16 DGX-H100 nodes (the paper's batch sizes),
with the communication share of the step, and how close each plan is to the planner's lower
bound on the step of any plan (`Evaluation.bound`: plan, bound, ratio, and the gap's parts).
Writes JSON and a PNG figure.

    python -m experiments.paper_eval.main [--out results/paper_eval.json]

The notebook `paper_eval.ipynb` beside this file runs the same code cell by cell.
"""

import argparse
import json
import os
import time

from embark_jax.cli.plan import default_batch
from embark_jax.planner import PlannerError, baseline, get_hardware, load_preset, plan

MODELS = ("dcnv2", "t180", "t200", "t510")
NODES = (1, 8, 16)


def evaluate(models=MODELS, nodes=NODES, topology="dgx-h100") -> list[dict]:
    rows = []
    for name in models:
        spec = load_preset(name)
        for n in nodes:
            hw = get_hardware(topology, n, 8)
            batch = default_batch(spec, n, 8)
            row = {"model": name, "nodes": n, "gpus": hw.num_devices, "batch": batch}
            try:
                t0 = time.perf_counter()
                ours = plan(spec, batch, hw)
                seconds = time.perf_counter() - t0
                # the paper's TRW as HugeCTR runs it: without our memory cap (no staging)
                trw = baseline(spec, batch, hw, "trw", memory_fraction=None)
            except PlannerError as e:
                row["error"] = str(e)
            else:
                row.update(
                    embark_ms=ours.step_s * 1e3,
                    trw_ms=trw.step_s * 1e3,
                    speedup=trw.step_s / ours.step_s,
                    comm_share=ours.comm_share,
                    trw_comm_share=trw.comm_share,
                    bound_ms=ours.bound.step_s * 1e3,
                    bound_ratio=ours.bound_ratio,
                    bound_binding=ours.bound.binding,
                    imbalance_ms=ours.gap.imbalance_s * 1e3,
                    extra_work_ms=ours.gap.extra_work_s * 1e3,
                    memory_ms=ours.gap.memory_s * 1e3,
                    plan=plan_shape(ours.plan),
                    planning_s=seconds,
                )
            rows.append(row)
    return rows


def plan_shape(p) -> str:
    """A plan in one line: tables per cluster and how many are split."""
    parts = []
    for cl in ("dp", "rb", "ub"):
        ts = [t for t in p.tables if t.cluster.value == cl]
        if ts:
            split = sum(1 for t in ts if t.row_shards * t.column_shards > 1)
            parts.append(f"{cl} {len(ts)}" + (f" ({split} split)" if split else ""))
    return ", ".join(parts)


def table(rows) -> str:
    """Plan, bound and ratio per setup (markdown), with the mean and worst ratio."""
    lines = [
        "| model | GPUs | plan | step ms | bound ms | ratio | gap: imbalance / extra work ms "
        "| TRW ms | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['gpus']} | {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['plan']} | {r['embark_ms']:.2f} | "
            f"{r['bound_ms']:.2f} | {r['bound_ratio']:.3f} | {r['imbalance_ms']:.2f} / "
            f"{r['extra_work_ms']:.2f} | {r['trw_ms']:.2f} | {r['speedup']:.2f}x |"
        )
    ratios = [r["bound_ratio"] for r in rows if "bound_ratio" in r]
    if ratios:
        lines.append(
            f"\nstep / bound: mean {sum(ratios) / len(ratios):.3f}x, worst {max(ratios):.3f}x "
            f"(goal: <= 1.1x mean, <= 1.2x each)"
        )
    return "\n".join(lines)


def figure(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in rows if "speedup" in r]
    labels = [f"{r['model']}\n{r['gpus']} GPUs" for r in ok]
    x = np.arange(len(ok))
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(max(6, len(ok) * 0.8), 8))
    a.bar(x, [r["speedup"] for r in ok], color="tab:green")
    a.axhline(1.0, color="k", lw=0.5)
    a.axhline(1.5, color="tab:gray", ls="--", lw=0.8, label="paper mean 1.5x")
    a.set_ylabel("speedup over TRW")
    a.set_xticks(x, labels, fontsize=7)
    a.legend(fontsize=8)
    b.bar(x - 0.2, [100 * r["trw_comm_share"] for r in ok], 0.4, label="TRW")
    b.bar(x + 0.2, [100 * r["comm_share"] for r in ok], 0.4, label="embark_jax")
    b.set_ylabel("communication % of step")
    b.set_xticks(x, labels, fontsize=7)
    b.legend(fontsize=8)
    c.bar(x, [r["bound_ratio"] for r in ok], color="tab:purple")
    c.axhline(1.2, color="tab:red", ls="--", lw=0.8, label="goal 1.2x")
    c.axhline(1.0, color="k", lw=0.5)
    c.set_ylim(0.9, max(1.3, max(r["bound_ratio"] for r in ok) + 0.05))
    c.set_ylabel("step / lower bound")
    c.set_xticks(x, labels, fontsize=7)
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="results/paper_eval.json")
    ap.add_argument("--quick", action="store_true", help="one model, one size (smoke test)")
    args = ap.parse_args(argv)
    rows = evaluate(("dcnv2",), (1,)) if args.quick else evaluate()
    for r in rows:
        if "speedup" in r:
            print(
                f"{r['model']:6s} {r['gpus']:4d} GPUs: embark {r['embark_ms']:7.2f} ms "
                f"(bound {r['bound_ms']:7.2f} ms, {r['bound_ratio']:.3f}x), TRW "
                f"{r['trw_ms']:7.2f} ms, speedup {r['speedup']:.2f}x, comm "
                f"{100 * r['comm_share']:.0f}% (TRW {100 * r['trw_comm_share']:.0f}%), "
                f"planned in {r['planning_s']:.2f} s"
            )
        else:
            print(f"{r['model']:6s} {r['gpus']:4d} GPUs: {r['error']}")
    print()
    print(table(rows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    figure(rows, png)
    print(f"wrote {args.out} and {png}")
    return rows


if __name__ == "__main__":
    main()
