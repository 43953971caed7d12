"""Command line: `python -m embark_jax <command>`."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embark_jax")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a small model on synthetic Zipf data (one device)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the metrics JSON here")
    sub.add_parser("info", help="print the native build and the registered FFI targets")
    from embark_jax.cli import plan as planner_cli
    from embark_jax.cli import train as train_cli

    train_cli.add_train_args(sub.add_parser("train", help="the main job: train a DLRM"))
    lp = sub.add_parser("launch", help="run a command in several local processes")
    lp.add_argument("--nproc", type=int, default=2)
    lp.add_argument("--devices-per-proc", type=int, default=4)
    lp.add_argument(
        "--grace", type=float, default=20.0, help="seconds the others get after one process fails"
    )
    lp.add_argument("rest", nargs=argparse.REMAINDER, help="-- <command> [args]")

    planner_cli.add_plan_args(sub.add_parser("plan", help="plan a paper model's sharding"))
    planner_cli.add_simulate_args(
        sub.add_parser(
            "simulate", help="predicted step time of our plan vs TRW for the paper's models"
        )
    )
    args = parser.parse_args(argv)

    if args.command == "demo":
        from embark_jax.cli.demo import run_demo

        run_demo(steps=args.steps, batch_size=args.batch_size, seed=args.seed, out=args.out)
    elif args.command == "train":
        return train_cli.run_train(args)
    elif args.command == "launch":
        from embark_jax.training.distributed import launch

        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        if not rest:
            parser.error("launch needs a command after --, e.g. -- train --steps 10")
        return launch(rest, args.nproc, args.devices_per_proc, grace_s=args.grace)
    elif args.command == "plan":
        return planner_cli.run_plan(args)
    elif args.command == "simulate":
        return planner_cli.run_simulate(args)
    elif args.command == "info":
        import embark_jax

        print(json.dumps(embark_jax.build_info(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
