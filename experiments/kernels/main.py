"""Kernel benchmark: ours vs XLA vs torch, per call (each library in its own process), or
in loop mode (each op K times inside one jit: what a GPU's kernels take, `loop.py`).

  python -m experiments.kernels.main                      # the 5 points, every op, 7 reps
  python -m experiments.kernels.main --quick              # one tiny point (seconds)
  python -m experiments.kernels.main --ops forward --libs embark,torch --repeats 15
  python -m experiments.kernels.main --floor --libs embark,torch --repeats 40
                                                          # one id vs 1024 x 8 x 64: the fixed
                                                          # price of a call, and the rows'
  python -m experiments.kernels.main --gpu-quick          # loop mode, the production points,
                                                          # most valuable first, 3 reps (the
                                                          # GPU check; capped on a CPU)
  python -m experiments.kernels.main --loop               # loop mode, every production point
  python -m experiments.kernels.main --loop --quick       # loop mode, two tiny points

Only a full per-call run (every op, the 5 points) writes `results/kernels.json` unless
`--out` says otherwise: a quick run writes `results/kernels_quick.json`, a `--floor` run
`results/kernels_floor.json` and a run of some ops or libraries `results/kernels_partial.json`,
so a smoke test never replaces the full results. Loop mode writes
`results/kernels_loop.json` (`--loop`), `kernels_loop_quick.json` (`--gpu-quick`) or
`kernels_loop_smoke.json` (`--loop --quick`).

Per call, torch is measured when installed (`pip install --no-build-isolation -e .[bench]`);
without it its column is left out and the run still exits 0. Exit status 1 when a library's
output disagrees with the reference's. The JSON schemas are in `experiments/kernels/bench.py`
and `experiments/kernels/loop.py`.
"""

import argparse
import os

from experiments.kernels import bench
from experiments.kernels import points as P

LOOP_OUT = {
    "full": "results/kernels_loop.json",
    "quick": "results/kernels_loop_quick.json",
    "smoke": "results/kernels_loop_smoke.json",
}


def default_out(quick: bool, partial: bool, floor: bool = False, loop: str | None = None) -> str:
    """Where a run writes without --out: only a full per-call run replaces
    results/kernels.json; a loop-mode run (`loop`: full, quick or smoke) has its own files."""
    if loop:
        return LOOP_OUT[loop]
    if quick:
        return "results/kernels_quick.json"
    if floor:
        return "results/kernels_floor.json"
    return "results/kernels_partial.json" if partial else "results/kernels.json"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out",
        default=None,
        help="the JSON (default: results/kernels.json for a full run; kernels_quick.json, "
        "kernels_floor.json, kernels_partial.json or kernels_loop*.json beside it for the "
        "others)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repetitions per library (default 7; loop mode 5, --gpu-quick at most 3)",
    )
    ap.add_argument("--reps-per-round", type=int, default=3, help="timed calls per turn")
    ap.add_argument(
        "--warm-per-turn", type=int, default=2, help="untimed calls before a turn's timed ones"
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="0: the CPUs we may run on")
    ap.add_argument(
        "--ops",
        default=None,
        help=f"comma list of {','.join(P.OPS)} (loop mode: {','.join(P.LOOP_OPS)})",
    )
    ap.add_argument("--libs", default=",".join(bench.LIBS), help="comma list")
    ap.add_argument("--quick", action="store_true", help="one small point (smoke test)")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="one id, then 1024 x 8 x 64: each library's fixed price per call and what the "
        "shape's rows cost above it (forward ops by default)",
    )
    loop = ap.add_argument_group("loop mode (loop.py)")
    loop.add_argument("--loop", action="store_true", help="each op K times inside one jit")
    loop.add_argument(
        "--gpu-quick",
        action="store_true",
        help="loop mode on the production points, most valuable first, at most 3 repeats, "
        "device times traced (the GPU check's mode)",
    )
    loop.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no op after this many seconds (the first point runs whole)",
    )
    loop.add_argument(
        "--target-bytes",
        type=float,
        default=None,
        help="bytes per loop call, which sets K (default 16e9 on a GPU, 2.56e8 on a CPU)",
    )
    loop.add_argument(
        "--copy-min-bytes", type=int, default=None, help="least bytes of the copy reference"
    )
    loop.add_argument(
        "--rotate-below-bytes",
        type=int,
        default=None,
        help="rotate the ids each iteration when the distinct rows' bytes are at most this",
    )
    loop.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="cap the points' batch (default: none on a GPU, 1024 on a CPU)",
    )
    loop.add_argument(
        "--max-vocab",
        type=int,
        default=None,
        help="cap the points' rows (default: none on a GPU, 100000 on a CPU)",
    )
    loop.add_argument(
        "--profile",
        type=int,
        default=None,
        help="trace one more loop call of the first N cases for device times (default: 8 "
        "with --gpu-quick, else 0)",
    )
    return ap


def main(argv=None):
    ap = _parser()
    args = ap.parse_args(argv)
    if args.floor and (args.quick or args.gpu_quick or args.loop):
        ap.error("--floor runs its own points: not with --quick, --loop or --gpu-quick")
    if args.loop or args.gpu_quick:
        return _loop_main(ap, args)
    points = P.QUICK_POINTS if args.quick else P.FLOOR_POINTS if args.floor else P.DEFAULT_POINTS
    ops = P.FLOOR_OPS if args.floor else P.OPS
    if args.ops:
        ops = tuple(args.ops.split(","))
        unknown = set(ops) - set(P.OPS)
        if unknown:
            ap.error(f"unknown ops: {', '.join(sorted(unknown))}")
    libs = tuple(args.libs.split(","))
    if "embark" not in libs or set(libs) - set(bench.LIBS):
        ap.error(f"--libs: embark and any of {', '.join(bench.LIBS[1:])}")
    repeats = 7 if args.repeats is None else args.repeats
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


def _loop_main(ap, args):
    from experiments.kernels import loop

    kind = "quick" if args.gpu_quick else "smoke" if args.quick else "full"
    tasks = {"quick": P.LOOP_QUICK, "smoke": P.LOOP_SMOKE, "full": P.LOOP_FULL}[kind]
    if args.ops:
        wanted = tuple(args.ops.split(","))
        unknown = set(wanted) - set(P.LOOP_OPS)
        if unknown:
            ap.error(f"unknown loop-mode ops: {', '.join(sorted(unknown))}")
        tasks = [(p, tuple(o for o in ops if o in wanted)) for p, ops in tasks]
        tasks = [(p, ops) for p, ops in tasks if ops]
    if set(args.libs.split(",")) - set(bench.LIBS):
        ap.error(f"--libs: any of {', '.join(bench.LIBS)} (loop mode runs embark and xla)")
    repeats = 5 if args.repeats is None else args.repeats
    if args.gpu_quick:
        repeats = min(repeats, 3)
    settings = loop.Settings(
        repeats=repeats,
        target_bytes=args.target_bytes,
        copy_min_bytes=args.copy_min_bytes,
        rotate_below_bytes=args.rotate_below_bytes,
        budget_s=args.budget_s,
        max_batch=args.max_batch,
        max_vocab=args.max_vocab,
        profile=(8 if args.gpu_quick else 0) if args.profile is None else args.profile,
    )
    args.out = args.out or default_out(False, False, loop=kind)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    result = loop.run(tasks, settings, args.out)
    print(f"wrote {args.out}")
    if not result["checks_ok"]:
        raise SystemExit("our output disagrees with XLA's (see 'check')")
    return result


if __name__ == "__main__":
    main()
