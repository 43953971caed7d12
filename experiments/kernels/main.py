"""Kernel benchmark: ours vs XLA vs torch, each library in its own process.

  python -m experiments.kernels.main                      # the 5 points, every op, 7 reps
  python -m experiments.kernels.main --quick              # one tiny point (seconds)
  python -m experiments.kernels.main --gpu-quick          # GPU check: forward + backward, 3 reps
  python -m experiments.kernels.main --ops forward --libs embark,torch --repeats 15
  python -m experiments.kernels.main --floor --libs embark,torch --repeats 40
                                                          # one id vs 1024 x 8 x 64: the fixed
                                                          # price of a call, and the rows'

Only a full run (every op, the 5 points) writes `results/kernels.json` unless `--out` says
otherwise: a quick run writes `results/kernels_quick.json`, a `--floor` run
`results/kernels_floor.json` and a run of some ops or libraries `results/kernels_partial.json`,
so a smoke test never replaces the full results.

torch is measured when installed (`pip install -e .[bench]`); without it its column is left
out and the run still exits 0. Exit status 1 when a library's output disagrees with the
reference's. The JSON schema is in `experiments/kernels/bench.py`.
"""

import argparse
import os

from experiments.kernels import bench
from experiments.kernels import points as P


def default_out(quick: bool, partial: bool, floor: bool = False) -> str:
    """Where a run writes without --out: only a full run replaces results/kernels.json."""
    if quick:
        return "results/kernels_quick.json"
    if floor:
        return "results/kernels_floor.json"
    return "results/kernels_partial.json" if partial else "results/kernels.json"


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out",
        default=None,
        help="the JSON (default: results/kernels.json for a full run; kernels_quick.json, "
        "kernels_floor.json or kernels_partial.json beside it for the others)",
    )
    ap.add_argument("--repeats", type=int, default=7, help="timed repetitions per library")
    ap.add_argument("--reps-per-round", type=int, default=3, help="timed calls per turn")
    ap.add_argument(
        "--warm-per-turn", type=int, default=2, help="untimed calls before a turn's timed ones"
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="0: the CPUs we may run on")
    ap.add_argument("--ops", default=None, help=f"comma list of {','.join(P.OPS)}")
    ap.add_argument("--libs", default=",".join(bench.LIBS), help="comma list")
    ap.add_argument("--quick", action="store_true", help="one small point (smoke test)")
    ap.add_argument(
        "--gpu-quick",
        action="store_true",
        help="the production points, forward and backward ops, at most 3 repeats (the GPU "
        "check's time-boxed mode)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="one id, then 1024 x 8 x 64: each library's fixed price per call and what the "
        "shape's rows cost above it (forward ops by default)",
    )
    args = ap.parse_args(argv)
    if args.floor and (args.quick or args.gpu_quick):
        ap.error("--floor runs its own points: not with --quick or --gpu-quick")
    points = P.QUICK_POINTS if args.quick else P.FLOOR_POINTS if args.floor else P.DEFAULT_POINTS
    ops = P.GPU_QUICK_OPS if args.gpu_quick else P.FLOOR_OPS if args.floor else P.OPS
    if args.ops:
        ops = tuple(args.ops.split(","))
        unknown = set(ops) - set(P.OPS)
        if unknown:
            ap.error(f"unknown ops: {', '.join(sorted(unknown))}")
    libs = tuple(args.libs.split(","))
    if "embark" not in libs or set(libs) - set(bench.LIBS):
        ap.error(f"--libs: embark and any of {', '.join(bench.LIBS[1:])}")
    repeats = min(args.repeats, 3) if args.gpu_quick else args.repeats
    partial = ops != P.OPS or set(libs) != set(bench.LIBS)
    args.out = args.out or default_out(args.quick, partial, args.floor)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    result = bench.run(
        points,
        repeats,
        args.out,
        reps_per_round=args.reps_per_round,
        warm_per_turn=args.warm_per_turn,
        warmup=args.warmup,
        threads=args.threads,
        ops=ops,
        libs=libs,
        copy_nbytes=1 << 24 if args.quick else 1 << 28,
        floor=args.floor,
    )
    print(f"wrote {args.out}")
    if not result["checks_ok"]:
        raise SystemExit("a library's output disagrees with the reference (see 'check')")
    return result


if __name__ == "__main__":
    main()
