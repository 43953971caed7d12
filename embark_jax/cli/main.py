"""Command line: `python -m embark_jax <command>` (or `embark-jax <command>`).

A user mistake (a bad flag, a plan file that does not parse or does not fit the devices, a
model that does not fit) is one `error:` line on stderr and exit code 2, never a traceback,
and nothing is written (`embark_jax.cli.errors`)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from embark_jax.cli.errors import (
    OneLineParser,
    check_writable_file,
    guarded,
    positive_float,
)
from embark_jax.cli.flags import add_counts


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to every option's help unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("embark_jax")
    except Exception:  # not installed (a source tree on sys.path)
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from embark_jax.cli import plan as plan_cli
    from embark_jax.cli import train as train_cli

    parser = OneLineParser(
        prog="python -m embark_jax",
        description="EMBark-style sharded embedding training, planning and simulation.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"embark_jax {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)

    p = add("demo", "train a small model on synthetic Zipf data (one device, no planner)")
    add_counts(p, {"--steps": (200, "training steps"), "--batch-size": (512, "batch size")})
    p.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    p.add_argument("--out", default=None, help="write the metrics JSON here (default: none)")
    add("info", "print the native build and the registered FFI targets as JSON")
    train_cli.add_train_args(
        add("train", "the main job: train a DLRM (synthetic Zipf or Criteo data)")
    )
    lp = add("launch", "run a command in several local processes (jax.distributed, gloo)")
    add_counts(
        lp,
        {
            "--nproc": (2, "processes to start"),
            "--devices-per-proc": (4, "fake CPU devices per process"),
        },
    )
    lp.add_argument(
        "--grace",
        type=positive_float,
        default=20.0,
        help="seconds the others get to finish after one process fails",
    )
    lp.add_argument(
        "--verbose", action="store_true", help="keep gloo's connection lines and blank lines"
    )
    lp.add_argument("rest", nargs=argparse.REMAINDER, help="-- <command> [args], e.g. -- train")
    plan_cli.add_plan_args(add("plan", "plan a paper model's sharding and explain it"))
    plan_cli.add_simulate_args(
        add("simulate", "predicted step time of our plan vs TRW for the paper's models")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("EMBARK_LAUNCHER_PID"):  # started by `launch`: die with the launcher
        from embark_jax.training.distributed import die_with_launcher

        die_with_launcher()
    return guarded(lambda: _run(argv))


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the resume hint
    if args.command == "demo":
        from embark_jax.cli.demo import run_demo

        if args.out:
            check_writable_file(args.out, "--out")
        run_demo(steps=args.steps, batch_size=args.batch_size, seed=args.seed, out=args.out)
    elif args.command == "train":
        from embark_jax.cli import train as train_cli

        return train_cli.run_train(args)
    elif args.command == "launch":
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        if not rest:
            parser.error("launch needs a command after --, e.g. -- train --steps 10")
        _check_launched(parser, rest)
        return _launch(rest, args)
    elif args.command in ("plan", "simulate"):
        from embark_jax.cli import plan as plan_cli

        return plan_cli.run_plan(args) if args.command == "plan" else plan_cli.run_simulate(args)
    elif args.command == "info":
        import embark_jax

        print(json.dumps(embark_jax.build_info(), indent=1), flush=True)
    return 0


# gloo's per-rank notice, "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of
# connected peer ranks is : 1"; the ranks' threads interleave its pieces within and across
# lines (seen: "[Gloo] Rank 1[Gloo] Rank 1 is ..."), so a line is noise when, once its process
# prefix, "[Gloo]" tags and digits are taken out, every word left is a notice word or the
# start or end of one (a word cut across two writes)
_PREFIXED = re.compile(r"^\[\d+\] (.*)$")
_GLOO_WORDS = "Rank is connected to peer ranks. Expected number of :".split()


def _is_noise(line: str) -> bool:
    m = _PREFIXED.match(line.rstrip("\n"))
    if m is None:
        return False
    rest = re.sub(r"\d+", " ", m.group(1).replace("[Gloo]", " "))
    return all(any(g.startswith(w) or g.endswith(w) for g in _GLOO_WORDS) for w in rest.split())


class _QuietLines:
    """stdout for `launch`: drops gloo's connection notices and prefixed blank lines (the
    launcher writes one whole prefixed line per `write`)."""

    def __init__(self, out):
        self.out = out

    def write(self, text: str) -> int:
        if text.endswith("\n") and _is_noise(text):
            return len(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name):
        return getattr(self.out, name)


def _check_launched(parser: argparse.ArgumentParser, rest: list[str]) -> None:
    """The launched command's flags (and, for `train`, the checks that need no devices),
    checked once here: a mistake is one `error:` line, not one per process."""
    inner = parser.parse_args(rest)
    if inner.command == "launch":
        parser.error("launch cannot launch itself; give the command to run, e.g. -- train")
    if inner.command == "train":
        from embark_jax.cli.train import DEFAULT_BATCH, check_args

        check_args(inner, DEFAULT_BATCH)


def _launch(rest: list[str], args) -> int:
    from embark_jax.training.distributed import launch

    if args.verbose:
        return launch(rest, args.nproc, args.devices_per_proc, grace_s=args.grace)
    real, sys.stdout = sys.stdout, _QuietLines(sys.stdout)
    try:
        return launch(rest, args.nproc, args.devices_per_proc, grace_s=args.grace)
    finally:
        sys.stdout = real


if __name__ == "__main__":
    sys.exit(main())
