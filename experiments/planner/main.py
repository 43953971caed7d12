"""Planner experiment: planning time as tables and devices grow (T510 subsets on DGX-H100
clusters), and the simulator report (our plan vs TRW for the paper's models).

    python -m experiments.planner.main [--quick] [--out results/planner.json]
"""

import argparse
import dataclasses
import json
import os
import time

from embark_jax.cli.plan import default_batch
from embark_jax.planner import PlannerError, get_hardware, load_preset, plan


def planning_times(table_counts, node_counts, rounds: int = 20) -> list[dict]:
    full = load_preset("t510")
    rows = []
    for n_tables in table_counts:
        model = dataclasses.replace(full, tables=full.tables[:n_tables])
        for nodes in node_counts:
            hw = get_hardware("dgx-h100", nodes, 8)
            batch = default_batch(full, nodes, 8)  # the paper's batch for the cluster size
            t0 = time.perf_counter()
            row = {"tables": n_tables, "devices": hw.num_devices}
            try:
                ev = plan(model, batch, hw, max_rounds=rounds)
            except PlannerError as e:  # the subset needs more memory than these devices have
                row.update(seconds=time.perf_counter() - t0, error=str(e))
                got = f"does not fit: {e}"
            else:
                row.update(seconds=time.perf_counter() - t0, step_ms=ev.step_s * 1e3)
                got = f"predicted step {row['step_ms']:.2f} ms"
            rows.append(row)
            print(
                f"tables {n_tables:4d} devices {hw.num_devices:4d}: planned in "
                f"{row['seconds']:6.2f} s ({got})",
                flush=True,
            )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="results/planner.json")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        rows = planning_times([16, 32], [1, 2])
    else:
        rows = planning_times([64, 128, 256, 510], [1, 4, 16])
    big = [
        r
        for r in rows
        if r["tables"] == max(x["tables"] for x in rows)
        and r["devices"] == max(x["devices"] for x in rows)
    ]
    print(
        f"largest case: {big[0]['tables']} tables on {big[0]['devices']} devices in "
        f"{big[0]['seconds']:.2f} s (goal: under 5 s for T510 on 128 devices)"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"planning_time": rows}, fh, indent=1)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
