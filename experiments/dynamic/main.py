"""Dynamic-table benchmark (CPU): million keys/s of `find` and `find_or_insert` at dim 64,
load factor 0.5 and 0.9, against a C++ std::unordered_map baseline built and run here.

    python -m experiments.dynamic.main                 # -> results/dynamic_bench.json
    python -m experiments.dynamic.main --quick         # tiny smoke run
    python -m experiments.dynamic.main --threads 1     # ours on one thread, as the baseline

What is timed and how: experiments/dynamic/bench.py.
"""

import argparse
import json
import os
import pathlib


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--capacity", type=int, default=1 << 18, help="slots of the table")
    ap.add_argument("--bucket-size", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1 << 16, help="ids per call")
    ap.add_argument("--load-factors", default="0.5,0.9")
    ap.add_argument("--repeats", type=int, default=9, help="timed calls per op")
    ap.add_argument("--threads", type=int, default=0, help="our kernels' threads (0: all CPUs)")
    ap.add_argument("--quick", action="store_true", help="a tiny table and batch (smoke test)")
    ap.add_argument(
        "--out",
        default=None,
        help="default results/dynamic_bench.json (results/dynamic_bench_quick.json with --quick)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        os.environ["EMBARK_CPU_THREADS"] = str(args.threads)  # read when the kernels load
    if args.quick:
        args.capacity, args.batch, args.repeats = 4096, 512, 2
    out = pathlib.Path(
        args.out
        or ("results/dynamic_bench_quick.json" if args.quick else "results/dynamic_bench.json")
    )
    from experiments.dynamic import bench

    result = bench.measure(
        capacity=args.capacity,
        bucket_size=args.bucket_size,
        dim=args.dim,
        batch=args.batch,
        load_factors=tuple(float(x) for x in args.load_factors.split(",")),
        repeats=args.repeats,
    )
    print(bench.table(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
