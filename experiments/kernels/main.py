"""Kernel benchmark: `python -m experiments.kernels.main [--quick | --gpu-quick] [--out results.json]`."""

import argparse

from experiments.kernels.bench import DEFAULT_POINTS, Point, run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="results/kernels.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one small point (smoke test)")
    ap.add_argument(
        "--gpu-quick",
        action="store_true",
        help="the production points at 3 repeats (the GPU check's time-boxed mode)",
    )
    args = ap.parse_args(argv)
    points = [Point(256, 4, 16, 5000, "zipf")] if args.quick else DEFAULT_POINTS
    repeats = min(args.repeats, 3) if args.gpu_quick else args.repeats
    import os

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    return run(points, repeats, args.out)


if __name__ == "__main__":
    main()
