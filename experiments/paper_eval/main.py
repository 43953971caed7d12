"""The paper's evaluation, predicted: end-to-end step time of our plan vs the TRW baseline for
DLRM-DCNv2, T180, T200 and T510 on 1, 8 and 16 DGX-H100 nodes (the paper's batch sizes),
with the communication share of the step. Writes JSON and a PNG figure.

    python -m experiments.paper_eval.main [--out results/paper_eval.json]

The notebook `paper_eval.ipynb` beside this file runs the same code cell by cell.
"""

import argparse
import json
import os

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
                ours, trw = plan(spec, batch, hw), baseline(spec, batch, hw, "trw")
            except PlannerError as e:
                row["error"] = str(e)
            else:
                row.update(
                    embark_ms=ours.step_s * 1e3,
                    trw_ms=trw.step_s * 1e3,
                    speedup=trw.step_s / ours.step_s,
                    comm_share=ours.comm_share,
                    trw_comm_share=trw.comm_share,
                )
            rows.append(row)
    return rows


def figure(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in rows if "speedup" in r]
    labels = [f"{r['model']}\n{r['gpus']} GPUs" for r in ok]
    x = np.arange(len(ok))
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(6, len(ok) * 0.8), 6))
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
                f"{r['model']:6s} {r['gpus']:4d} GPUs: embark {r['embark_ms']:7.2f} ms, TRW "
                f"{r['trw_ms']:7.2f} ms, speedup {r['speedup']:.2f}x, comm "
                f"{100 * r['comm_share']:.0f}% (TRW {100 * r['trw_comm_share']:.0f}%)"
            )
        else:
            print(f"{r['model']:6s} {r['gpus']:4d} GPUs: {r['error']}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    figure(rows, png)
    print(f"wrote {args.out} and {png}")
    return rows


if __name__ == "__main__":
    main()
