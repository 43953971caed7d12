"""User mistakes on the command line: one `error:` line on stderr and exit code 2, never a
traceback, and nothing written. Flags are checked by argparse types (`positive_int`,
`model_name`, ...); what only shows later (a plan file, the local device count, a model that
does not fit) raises `CLIError`, `PlanError` or `PlannerError`, which `guarded` turns into
the same one line."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable

from embark_jax.core.plan import MAX_BATCH_SIZE

__all__ = [
    "INTERRUPTED",
    "CLIError",
    "OneLineParser",
    "batch_size",
    "check_writable_dir",
    "check_writable_file",
    "guarded",
    "make_parent",
    "model_name",
    "models_help",
    "nonneg_int",
    "positive_float",
    "positive_int",
    "topology_name",
]

USAGE_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C


class CLIError(Exception):
    """A user mistake found after the flags were parsed; the message is the whole story."""


class OneLineParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line (no usage block) with exit code 2."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def guarded(run: Callable[[], int]) -> int:
    """Runs `run()`; a user mistake becomes one `error:` line and exit code 2, Ctrl-C one
    `interrupted` line and exit code 130, and a closed pipe (`embark-jax info | head`) a
    quiet exit."""
    from embark_jax.core.plan import PlanError
    from embark_jax.planner import PlannerError

    try:
        _check_environment()
        return run()
    except (CLIError, PlanError, PlannerError) as e:
        _flush_quietly()
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USAGE_ERROR
    except KeyboardInterrupt:  # Ctrl-C outside training (which reports its own step)
        _flush_quietly()
        print("interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    except BrokenPipeError:
        # the reader went away: send the rest to /dev/null so the interpreter's own final
        # flush does not raise again, and exit quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _check_environment() -> None:
    """The environment switches the kernels read (EMBARK_CPU_ISA, EMBARK_CPU_THREADS,
    EMBARK_HUGEPAGES), checked before a command runs, so a bad value is the same one line (no
    JAX is imported here)."""
    from embark_jax.core.cpu_env import check_cpu_env

    try:
        check_cpu_env()
    except ValueError as e:
        raise CLIError(str(e)) from None


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


# --- argparse types ------------------------------------------------------------------------


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def batch_size(text: str) -> int:
    """A global batch: >= 1 and at most `core.plan.MAX_BATCH_SIZE` (int32 ids index it)."""
    value = positive_int(text)
    if value > MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_BATCH_SIZE}, got {value}")
    return value


def nonneg_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _aliases() -> dict[str, list[str]]:
    """Documented aliases of each full-size preset (`-mini` versions follow), from
    `embark_jax.planner.preset_aliases` when the planner lists them."""
    from embark_jax import planner

    listing = getattr(planner, "preset_aliases", None)
    pairs = dict(listing()) if listing else {"dlrm-dcnv2": "dcnv2", "dlrm_dcnv2": "dcnv2"}
    out: dict[str, list[str]] = {}
    for alias, name in pairs.items():
        if alias != name and not name.endswith("-mini"):
            out.setdefault(name, []).append(alias)
    return out


def models_help() -> str:
    """The preset names and their aliases, for `--help`."""
    from embark_jax.planner import preset_names

    groups = [" = ".join([n, *sorted(a)]) for n, a in sorted(_aliases().items())]
    text = f"a paper model preset: {', '.join(preset_names())}"
    return f"{text}; aliases: {', '.join(groups)} (also with -mini)" if groups else text


def model_name(text: str) -> str:
    """A preset name or alias accepted by `embark_jax.planner.load_preset`."""
    from embark_jax.planner import load_preset

    try:
        load_preset(text)
    except (ValueError, KeyError) as e:
        raise argparse.ArgumentTypeError(str(e).strip("'\"")) from None
    return text


def topology_name(text: str) -> str:
    """A hardware preset of `embark_jax.planner.PRESETS` or `local`."""
    from embark_jax.planner import PRESETS

    if text not in PRESETS and text not in ("local", "local-cpu", "cpu"):
        raise argparse.ArgumentTypeError(
            f"unknown topology {text!r}; choose from {', '.join(sorted(PRESETS))} or local"
        )
    return text


# --- output paths: checked before any work, so a bad one fails before step 1 --------------


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _probe(directory: str, flag: str, target: str) -> None:
    """Creates and removes a file in `directory` (works as root, unlike `os.access`)."""
    if not os.path.isdir(directory):
        raise CLIError(f"{flag} {target!r}: {directory!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise CLIError(f"{flag} {target!r} is not writable: {e.strerror or e}") from None


def check_writable_dir(path: str, flag: str, target: str | None = None) -> None:
    """`path` is a writable directory or can be created as one; creates nothing."""
    target = path if target is None else target
    if os.path.exists(path) and not os.path.isdir(path):
        raise CLIError(f"{flag} {target!r}: {path!r} exists and is not a directory")
    _probe(_existing_ancestor(path), flag, target)


def check_writable_file(path: str, flag: str) -> None:
    """`path` can be written as a file (its folder may still have to be created)."""
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path!r} is a directory, not a file")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise CLIError(f"{flag} {path!r} is not writable")
        return
    check_writable_dir(os.path.dirname(os.path.abspath(path)), flag, path)


def make_parent(path: str) -> str:
    """Creates the folder of output file `path` if missing (checked writable before anything
    ran, by `check_writable_file`) and returns `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CLIError(message)
