"""Flag definitions several commands share, and flags whose choices are a library enum's
names (the enum is the one list; the command line never spells it again)."""

from __future__ import annotations

import argparse

from embark_jax.cli.errors import batch_size, positive_int
from embark_jax.core.choice import Choice

__all__ = ["add_batch_size", "add_choice", "add_counts"]


def add_counts(p: argparse.ArgumentParser, flags: dict[str, tuple[int, str]]) -> None:
    """One flag per entry that takes an int >= 1: `{name: (default, help)}`."""
    for name, (default, text) in flags.items():
        p.add_argument(name, type=positive_int, default=default, help=text)


def add_batch_size(p: argparse.ArgumentParser, default: str) -> None:
    """`--batch-size`: the global batch (None when not given); `default` says in words what
    the command takes then."""
    p.add_argument(
        "--batch-size",
        type=batch_size,
        default=None,
        help=f"global batch, a multiple of the devices (default: {default})",
    )


def add_choice(p: argparse.ArgumentParser, name: str, default: Choice, text: str) -> None:
    """A flag whose value is one of `default`'s enum's names (a string; parse it with the
    enum's `parse`)."""
    choices = [c.value for c in type(default)]
    p.add_argument(name, default=default.value, choices=choices, help=text)
