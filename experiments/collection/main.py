"""The whole embedding step (lookup + pool of every feature, backward, fused row-wise Adagrad)
of embark_jax against FBGEMM's TBE on one CPU device, each contender in its own process.

  python -m experiments.collection.main                  # the three workloads, 3 rounds x 10
  python -m experiments.collection.main --quick          # tiny shapes (the smoke test)
  python -m experiments.collection.main --workloads one-4m --contenders embark,tbe

Workloads (`workloads.py`): dcnv2-mini (the preset's 26 tables, batch 4096), tables-100 (100
tables of 1e4..1e6 rows, dims 32/64, hotness 1..10, batch 8192), one-4m (one 4M x 128 table,
hotness 32, batch 4096); ids from the library's synthetic Zipf data (`--ids uniform` for uniform
ones). TBE is run when torch and fbgemm-gpu-cpu are installed (`pip install --no-build-isolation
-e .[bench]`); without them its row is left out and the run still exits 0. Exit status 1 when a
contender's step 1 disagrees with the reference. Only a full run (every workload, each one's
contenders) writes results/collection_bench.json unless `--out` says otherwise: a quick run
writes results/collection_bench_quick.json and a partial one
results/collection_bench_partial.json. The JSON schema is in `bench.py`.
"""

from __future__ import annotations

import argparse

from experiments.collection import bench
from experiments.collection import workloads as W


def default_out(quick: bool, partial: bool) -> str:
    if quick:
        return "results/collection_bench_quick.json"
    return "results/collection_bench_partial.json" if partial else "results/collection_bench.json"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds x 2 steps")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="steps per turn (default 10)")
    ap.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    ap.add_argument("--workloads", default=None, help="comma list (default: all)")
    ap.add_argument(
        "--contenders",
        default=None,
        help=f"comma list of {','.join(W.CONTENDERS)} (default: each workload's own)",
    )
    ap.add_argument("--ids", choices=("zipf", "uniform"), default="zipf")
    ap.add_argument("--index-dtype", choices=("int32", "int64"), default="int32", help="TBE's ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp-dir", default=None, help="where the inputs are written")
    ap.add_argument(
        "--schedule",
        choices=("auto", "interleaved", "one-at-a-time"),
        default="auto",
        help="contenders alive at once and interleaved, or one after the other; auto: "
        "interleaved when the machine has memory for all of them",
    )
    ap.add_argument(
        "--memory-wait-s",
        type=float,
        default=600.0,
        help="how long a contender waits for free memory before it is skipped",
    )
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> dict:
    ap = _parser()
    args = ap.parse_args(argv)
    all_workloads = W.quick() if args.quick else W.full()
    workloads = all_workloads
    if args.workloads:
        wanted = args.workloads.split(",")
        known = {w.name for w in all_workloads}
        unknown = sorted(set(wanted) - known)
        if unknown:
            ap.error(f"unknown workloads {unknown}; choose from {sorted(known)}")
        workloads = [w for w in all_workloads if w.name in wanted]
    contenders = None
    if args.contenders:
        contenders = tuple(args.contenders.split(","))
        unknown = sorted(set(contenders) - set(W.CONTENDERS))
        if unknown:
            ap.error(f"unknown contenders {unknown}; choose from {list(W.CONTENDERS)}")
    for name in ("rounds", "steps", "batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name} must be >= 1")
    settings = bench.Settings(
        rounds=args.rounds or (2 if args.quick else 3),
        steps=args.steps or (2 if args.quick else 10),
        batches=args.batches,
        seed=args.seed,
        ids=args.ids,
        index_dtype=args.index_dtype,
        contenders=contenders,
        tmp_dir=args.tmp_dir,
        memory_wait_s=args.memory_wait_s,
        schedule=args.schedule,
    )
    partial = workloads != all_workloads or contenders is not None
    out = args.out or default_out(args.quick, partial)
    result = bench.run(workloads, settings, out)
    print(f"wrote {out}")
    if not result["checks_ok"]:
        raise SystemExit("a contender's step 1 disagrees with the reference (see 'check')")
    return result


if __name__ == "__main__":
    main()
