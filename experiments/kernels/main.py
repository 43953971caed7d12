"""Kernel benchmark: `python -m experiments.kernels.main [--quick] [--out results.json]`."""

import argparse

from experiments.kernels.bench import DEFAULT_POINTS, Point, run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="results/kernels.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one small point (smoke test)")
    args = ap.parse_args(argv)
    points = [Point(256, 4, 16, 5000, "zipf")] if args.quick else DEFAULT_POINTS
    import os

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    return run(points, args.repeats, args.out)


if __name__ == "__main__":
    main()
